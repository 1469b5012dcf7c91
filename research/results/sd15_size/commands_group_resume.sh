#!/bin/bash
# Issue 55 "Done when": the second layout (a learner group of 2) also resumes at SD1.5's size: 2 samplers,
# 2 learners, 1 reward actor, the buffer, 2 epochs under a 20 GB cgroup cap, then --resume to 3 epochs.
cd "$(dirname "$0")/../../.."
export DIFFRLHF_CACHE=/tmp/sd15run/cache RAY_USAGE_STATS_ENABLED=0
O="model.name=sd15-random model.device=cpu sample.resolution=64 sample.num_steps=2 sample.batch_size=2 sample.batches_per_epoch=2 train.batch_size=2 run.out_dir=/tmp/sd15run/runs run.image_grid_every=0 run.tensorboard=false system.idle_timeout_s=1800 system.start_timeout_s=1800 system.num_samplers=2 system.num_learners=2"
s=$(date +%s)
research/capped.sh 20G diffrlhf train --no-progress $O train.epochs=2 run.name=group2r > /tmp/sd15run/group2r.log 2>&1
echo "group2r rc=$? in $(( $(date +%s) - s )) s" >> /tmp/sd15run/status_group
s=$(date +%s)
research/capped.sh 20G diffrlhf train --no-progress --resume /tmp/sd15run/runs/group2r train.epochs=3 > /tmp/sd15run/group2r_resume.log 2>&1
echo "group2r resume rc=$? in $(( $(date +%s) - s )) s" >> /tmp/sd15run/status_group
