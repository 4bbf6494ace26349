"""The cluster side: sbatch scripts (train.sbatch) and train.py's SLURM requeue handling (requeue.py)."""
