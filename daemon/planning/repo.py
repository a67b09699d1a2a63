"""`moestreamctl plan REPO_ID`: a hub repository's store, planned before any weight is downloaded.

The repository's small files (its config, weight index and tokenizer) and each weight
file's safetensors header (a range request) are all it reads; mlx-lm lays the store out
from them as `pull` will write it (daemon/store/pull.py `describe_repo`), so the plan's
sizes are the store's own, and the rest of the plan is `plan --model STORE`'s arithmetic
(daemon/planning/plan.py `plan_shape`).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ...shared.store_format import Manifest
from ..store.hub import default_store_dir, fetch_file, list_repo, weight_headers
from ..store.pull import check_config, describe_repo
from ..store.source import tokenizer_files
from .plan import StoreShape
from .probe_models import dominant_dtype


@contextmanager
def repo_shape(
    repo_id: str,
    revision: str | None = None,
    *,
    endpoint: str | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> Iterator[StoreShape]:
    """The shape of the store `pull repo_id` would write (a repository that is not an MoE
    model mlx-lm can load refused from its config, as the pull refuses it); its small
    files lie in a temporary folder until the block ends."""
    listing = list_repo(repo_id, revision, endpoint)
    say(f"reading {repo_id}'s config and the headers of its {len(listing.weights)} weight files from the hub")
    with tempfile.TemporaryDirectory(prefix="moestream-plan-") as tmp:
        small = Path(tmp)
        for f in listing.small:
            fetch_file(listing, f, small, say=say, endpoint=endpoint)
            if f.name == "config.json":
                check_config(small, repo_id)
        layout = describe_repo(small, weight_headers(listing, endpoint))
        tokenizer = tokenizer_files(small)
        manifest = Manifest(
            model_type=layout.model_type,
            config=layout.config,
            resident_files=tuple(name for name, _ in layout.resident),
            tokenizer_files=tuple(p.name for p in tokenizer),
            layers=layout.layers,
            source={"repo_id": repo_id, "revision": listing.commit},
        )
        yield StoreShape(
            name=f"{repo_id} at {listing.commit[:12]}",
            manifest=manifest,
            resident_bytes=layout.resident_bytes,
            store_bytes=layout.store_bytes(sum(p.stat().st_size for p in tokenizer)),
            dtype=dominant_dtype(layout.resident_dtype_bytes),
            tokenizer_dir=small,
            disk_dir=default_store_dir(repo_id, revision),
        )
