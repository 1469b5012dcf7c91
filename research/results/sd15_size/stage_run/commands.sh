#!/bin/bash
cd /work/main
export DIFFRLHF_CACHE=/tmp/sd15run/cache RAY_USAGE_STATS_ENABLED=0
O="model.name=sd15-random model.device=cpu sample.resolution=64 sample.num_steps=2 sample.batch_size=2 sample.batches_per_epoch=2 train.batch_size=2 run.out_dir=/tmp/sd15run/runs run.image_grid_every=0 run.tensorboard=false system.idle_timeout_s=1800 system.start_timeout_s=1800"
s=$(date +%s)
research/capped.sh 20G diffrlhf train --no-progress $O train.epochs=3 system.num_samplers=2 run.name=stage > /tmp/sd15run/stage.log 2>&1
echo "stage done rc=$? in $(( $(date +%s) - s )) s" >> /tmp/sd15run/status
