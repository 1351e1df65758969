"""bmt.config (BMTrain's global configuration dict), filled in place by init_distributed."""

config = {
    "initialized": False,
    "rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "local_size": 1,
    "save_param_to_cpu": True,
}


def rank():
    """The global rank of this process (0 before init_distributed)."""
    return config["rank"]


def world_size():
    """The number of processes (1 before init_distributed)."""
    return config["world_size"]
