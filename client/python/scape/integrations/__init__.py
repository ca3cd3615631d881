"""scape.integrations - scaped inside the training frameworks users run.

Each framework's module is imported on its own (scape.integrations.hf for
the Hugging Face Trainer); importing this package imports no framework.  launch_ranks() is their
common reading of the launch environment.
"""
import os


def _env_int(who, name, default):
    v = os.environ.get(name, "")
    if v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError("%s: %s=%r is not a number" % (who, name, v)) from None


def launch_ranks(who):
    """{"rank", "world_size", "local_rank", "node_rank"} from RANK, WORLD_SIZE,
    LOCAL_RANK and NODE_RANK, which scape-run and the Slurm templates set
    (without them: one trainer, 0, 1, 0, 0); ValueError, naming `who`, when
    they do not make a rank of the world."""
    got = dict(rank=_env_int(who, "RANK", 0), world_size=_env_int(who, "WORLD_SIZE", 1),
               local_rank=_env_int(who, "LOCAL_RANK", 0),
               node_rank=_env_int(who, "NODE_RANK", 0))
    if got["world_size"] < 1 or not 0 <= got["rank"] < got["world_size"] or \
            got["local_rank"] < 0 or got["node_rank"] < 0:
        raise ValueError("%s: RANK=%d, WORLD_SIZE=%d, LOCAL_RANK=%d, NODE_RANK=%d: need "
                         "0 <= RANK < WORLD_SIZE (launch with scape-run or the Slurm "
                         "templates)" % (who, got["rank"], got["world_size"],
                                         got["local_rank"], got["node_rank"]))
    return got
