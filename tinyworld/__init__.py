"""The tiny world: the embedded default model and the procedural world it was pretrained on.

scenes.py        captioned 64 px pictures of coloured shapes, the train/held-out split, the colour check
architecture.py  SD1.5's architecture at a CPU-sized width (and the seeded random `tiny-random` model)
weights.py       the committed pretrained weights (model/), assembled into a diffusers folder
pretrain.py      how those weights were made (python -m diffrlhf.tinyworld.pretrain)
evaluate.py      whether the model draws what its captions say
"""
