"""Where a checkpoint's files are: a local directory as given, or a hub name ORG/NAME[@revision] resolved to its snapshot in the Hugging Face cache (downloaded first when missing)."""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger("engine.model_source")

# Weight formats the engine never reads (it loads *.safetensors), skipped when downloading a model.
_UNREAD_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "original/*")
# A hub repository id with exactly one slash (the hub's own characters), then an optional @revision.
_HUB_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(?:@(?P<revision>[^\s@]+))?")


def split_hub_name(name: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when `name` has the shape ORG/NAME[@revision], else None."""
    match = _HUB_NAME.fullmatch(name)
    if match is None or ".." in match["repo"] or match["repo"].endswith((".", "-")):
        return None
    return match["repo"], match["revision"]


def hub_repo_id(name: str) -> str:
    """The name to show for a checkpoint: ORG/NAME without its @revision for a hub name, else `name` itself."""
    if os.path.isdir(name):
        return name
    parts = split_hub_name(name)
    return name if parts is None else parts[0]


def resolve_checkpoint(
    name: str,
    *,
    field: str = "model",
    revision: str | None = None,
    download_dir: str | None = None,
    token: bool | str | None = None,
    weights: bool = True,
    need_config: bool = True,
) -> str:
    """The local directory of checkpoint `name`: a directory with a config.json as given, or a hub name's snapshot.

    A hub name is looked up with huggingface_hub.snapshot_download, which honours HF_HOME / HF_HUB_CACHE
    (or `download_dir`), HF_HUB_OFFLINE and HF_TOKEN, and shows its progress bars while it downloads.
    `weights=False` fetches everything but weight files (a tokenizer, or a model loaded with dummy weights);
    `need_config=False` (a tokenizer) takes a local directory without a config.json.
    Errors are ValueErrors naming `field` and saying what to do.
    """
    if os.path.isdir(name) or os.path.exists(name):
        if need_config and not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"{field}: {name!r} is not a directory with a config.json")
        return name
    parts = split_hub_name(name)
    if parts is None:
        raise ValueError(
            f"{field}: {name!r} is not a directory with a config.json (nor a hub name of the form ORG/NAME[@revision])"
        )
    repo_id, name_revision = parts
    if name_revision is not None and revision is not None and name_revision != revision:
        raise ValueError(f"{field}: {name!r} names revision {name_revision!r} but the revision given is {revision!r}")
    revision = name_revision or revision
    path = _snapshot(repo_id, field, revision, download_dir, token, weights)
    if need_config and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{field}: the hub model {repo_id!r} (snapshot {path}) has no config.json")
    logger.info("%s: %s%s is %s", field, repo_id, f"@{revision}" if revision else "", path)
    return path


def _snapshot(repo_id: str, field: str, revision: str | None, download_dir: str | None, token, weights: bool) -> str:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    ignore = list(_UNREAD_WEIGHTS) + ([] if weights else ["*.safetensors"])
    try:
        return huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, token=token, ignore_patterns=ignore
        )
    except RevisionNotFoundError:
        raise ValueError(f"{field}: revision {revision!r} is not a branch, tag or commit of the hub model {repo_id!r}") from None
    except RepositoryNotFoundError:  # also gated and private repositories the token cannot read
        raise ValueError(
            f"{field}: {repo_id!r} is not a local directory, and the hub has no model of that name that can be read "
            f"(for a private or gated model pass --hf-token or set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as e:
        cache = download_dir or constants.HF_HUB_CACHE
        at = f"@{revision}" if revision else ""
        download = f"huggingface-cli download {repo_id}" + (f" --revision {revision}" if revision else "") + (
            f" --cache-dir {download_dir}" if download_dir else "")
        why = "downloads are off (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else f"the hub could not be reached ({e})"
        advice = "unset HF_HUB_OFFLINE to download it, " if constants.HF_HUB_OFFLINE else ""
        raise ValueError(
            f"{field}: {repo_id + at!r} is not a local directory and has no complete snapshot in the Hugging Face cache "
            f"({cache}), and {why}: {advice}download it first with `{download}`, or pass a local checkpoint directory"
        ) from None
