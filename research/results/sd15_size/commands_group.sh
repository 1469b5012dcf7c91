#!/bin/bash
# Issue 55 step 2: a learner group of 2 at SD1.5's size (2 samplers, 2 learners, 1 reward actor, the
# buffer), 2 epochs under a 20 GB cgroup cap, then the same with one learner, side by side.
cd "$(dirname "$0")/../../.."
export DIFFRLHF_CACHE=/tmp/sd15run/cache RAY_USAGE_STATS_ENABLED=0
O="model.name=sd15-random model.device=cpu sample.resolution=64 sample.num_steps=2 sample.batch_size=2 sample.batches_per_epoch=2 train.batch_size=2 run.out_dir=/tmp/sd15run/runs run.image_grid_every=0 run.tensorboard=false system.idle_timeout_s=1800 system.start_timeout_s=1800 train.epochs=2 system.num_samplers=2"
for L in 2 1; do
  s=$(date +%s)
  research/capped.sh 20G diffrlhf train --no-progress $O system.num_learners=$L run.name=group$L > /tmp/sd15run/group$L.log 2>&1
  echo "group$L rc=$? in $(( $(date +%s) - s )) s" >> /tmp/sd15run/status_group
done
