"""Names and fixed values of the `deepspeed` launcher (upstream module path: deepspeed.launcher.constants)."""

PDSH_LAUNCHER = "pdsh"
PDSH_MAX_FAN_OUT = 1024  # pdsh -f: how many hosts it contacts at once
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
MVAPICH_TMP_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"  # written for mpirun --hostfile, as upstream
ELASTIC_TRAINING_ID_DEFAULT = "123456789"

DLTS_HOSTFILE = "/job/hostfile"  # the default --hostfile (read only when it exists)
# Variables whose names start with these are exported to every node (plus the accelerator's:
# NCCL on CUDA hosts), as upstream's EXPORT_ENVS.
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
# On AISC clusters each node sets these itself: exporting rank 0's values would be wrong.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ["NCCL_IB_HCA", "UCX_NET_DEVICES"]}
