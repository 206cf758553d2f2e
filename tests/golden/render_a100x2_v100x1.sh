#!/bin/bash
# An EDDIS job: one smb-server per node, then the trainers (eddis-train --job).
# Submit: sbatch eddis_job.sh train.py [args]   (eddis submit writes scripts like this one)
#SBATCH --job-name=resnet
#SBATCH --output=eddis-%j.out
#SBATCH --account=proj42
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --partition=a100
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:a100:4
#SBATCH --time=02:00:00
#SBATCH hetjob
#SBATCH --partition=v100
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:v100:8
#SBATCH --time=02:00:00

set -u

# Settings of every rank and server: EDDIS_* and SMB_* (table in docs/user-guide.md).
export EDDIS_MODE=hybrid
export SMB_MEMORY=8G

# What to run: the arguments after the script name (sbatch eddis_job.sh train.py --epochs 3),
# else the command written here. eddis-train --job runs the servers, the trainers and the report.
[ $# -gt 0 ] || set -- train.py --epochs 3
exec eddis-train --job -- "$@"
