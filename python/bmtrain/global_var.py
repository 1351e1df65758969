"""bmt.config (BMTrain's global configuration dict), filled in place by init_distributed."""

config = {
    "initialized": False,
    "rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "local_size": 1,
    "save_param_to_cpu": True,
}


def _require_init(name):
    if not config["initialized"]:
        raise RuntimeError(f"bmtrain.{name}() was called before bmtrain.init_distributed(): the rank layout is not "
                           "known yet; call bmt.init_distributed() first (BMTrain returns the placeholder "
                           f"{config[name]} here, which silently makes every process rank 0 of 1)")


def rank():
    """The global rank of this process. Raises RuntimeError before init_distributed (BMTrain returns 0)."""
    _require_init("rank")
    return config["rank"]


def world_size():
    """The number of processes. Raises RuntimeError before init_distributed (BMTrain returns 1)."""
    _require_init("world_size")
    return config["world_size"]
