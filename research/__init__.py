"""The lab beside the product: benchmarks, studies, their results and the research-only rewards.

Run from the repository root (python -m research.bench.<name>); it imports the installed
`diffrlhf` package, which imports nothing from here.
"""
