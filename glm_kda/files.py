"""Finding a checkpoint's files: a local directory, or a hub repo through huggingface_hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError


class CheckpointError(ValueError):
    """A checkpoint that does not hold the KDA layer the config describes."""


def _local_dir(location: str | Path) -> Path | None:
    """The local directory `location` names, or None when it is a hub repo id ("owner/name")."""
    if isinstance(location, Path):
        return location
    text = str(location)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text.startswith(("/", ".", "~")) or text.count("/") != 1 or "\\" in text:
        return path
    # "owner/name" is a hub repo id, unless a folder `owner` is here: then it is a local path
    # (mistyped, say), never a request to the hub.
    if path.parent.is_dir():
        return path
    return None


def resolve_file(dir_or_repo_id: str | Path, filename: str, **hub_kwargs: Any) -> Path:
    """The local path of `filename` in a checkpoint directory, or downloaded from a hub repo.

    hub_kwargs go to `huggingface_hub.hf_hub_download` (revision, cache_dir, token,
    local_files_only, ...); its cache, progress bars and HF_HUB_OFFLINE apply as usual.
    """
    local = _local_dir(dir_or_repo_id)
    if local is not None:
        if not local.is_dir():
            raise CheckpointError(f"{local}: no such checkpoint directory")
        path = local / filename
        if not path.is_file():
            raise CheckpointError(f"{local}: no file '{filename}'")
        return path
    try:
        return Path(hf_hub_download(repo_id=str(dir_or_repo_id), filename=filename, **hub_kwargs))
    except EntryNotFoundError as exc:
        raise CheckpointError(
            f"hub repo '{dir_or_repo_id}': no file '{filename}' (or not in the local cache while offline)"
        ) from exc
