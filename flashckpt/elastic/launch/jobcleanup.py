"""After a ``flashckpt run`` whose workers finished: the job's leftover keys removed from the
etcd its flags name (:func:`~flashckpt.elastic.membership.jobkeys.remove_finished_job_keys`).
Moved here from :mod:`flashckpt.elastic.membership.jobkeys` (issue 45: it reads the launcher's
config and builds a rendezvous client, which ``membership/`` may not import)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flashckpt.elastic.membership.jobkeys import remove_finished_job_keys

if TYPE_CHECKING:
    from flashckpt.elastic.launch.config import LauncherConfig

__all__ = ["remove_after_launch"]

logger = logging.getLogger("flashckpt.launcher")


def remove_after_launch(config: LauncherConfig) -> int | None:
    """:func:`~flashckpt.elastic.membership.jobkeys.remove_finished_job_keys` for the job of a
    ``flashckpt run`` that ended with exit code 0, on the etcd its flags name (nothing for
    ``--standalone``: that etcd is gone with the launcher). Never raises."""
    if config.standalone or not config.rdzv_endpoint:
        return None
    # Not at the top: the rendezvous module imports torch.
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from flashckpt.elastic.rendezvous.backend import DEFAULT_KEY_PREFIX, create_client, job_prefix
    from flashckpt.elastic.rendezvous.name import BACKEND_NAME

    try:
        params = RendezvousParameters(
            backend=BACKEND_NAME,
            endpoint=config.rdzv_endpoint,
            run_id=config.rdzv_id,
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            **{**config.rdzv_conf, **config.etcd_options(), "read_timeout": "2"},
        )
        client = create_client(params)
        prefix = job_prefix(config.rdzv_id, str(params.get("key_prefix", DEFAULT_KEY_PREFIX)))
    except Exception as exc:  # the session checked these flags; never a reason to fail
        logger.info("not removing the finished job's keys: %s", exc)
        return None
    return remove_finished_job_keys(client, prefix)
