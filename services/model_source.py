"""The base model's one source, shared by the services that read it.

In a cluster no two pods share a filesystem, yet the trainer must start from the model
inference serves and envs must tokenize with it. ``push_model`` uploads an HF-layout
directory under an object-store prefix, its file list (sizes and SHA-256) written last
as the commit; ``sync_model`` brings it into a pod's ``model.dir`` when the service
starts, verified, into a temporary directory renamed into place, so ranks or pods that
sync at once never see half a model.

``fingerprint`` names a model by what must agree between trainer and inference: its
architecture (config.json less the fields that do not change the network) and its
tokenizer files. Torch-free: it runs before a service imports anything heavy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from services.objectstore import ObjectNotFound, ObjectStore

FILE_LIST = "model-files.json"
"""Written last under the prefix: each file's size and SHA-256 (the upload's commit)."""
SOURCE_MARK = ".etude-model-source.json"
"""Written into a synced directory: the prefix and file list it came from."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# config.json fields that do not change the network: dtype, the writer's version, names.
_NOT_ARCHITECTURE = {"torch_dtype", "dtype", "transformers_version", "_name_or_path"}


class ModelSourceError(RuntimeError):
    """The model could not be brought from its source, or two sources disagree."""


class ModelMismatch(ModelSourceError):
    """Trainer and inference hold different models (architecture or tokenizer)."""


@dataclass(frozen=True)
class Fingerprint:
    """What trainer and inference must agree on: architecture and tokenizer, hashed
    (``where``: the directory it was taken of, for messages; not compared)."""

    architecture: str
    tokenizer: str
    where: str = field(default="", compare=False)

    def __str__(self) -> str:
        place = f"{self.where}: " if self.where else ""
        return f"{place}architecture {self.architecture[:12]}, tokenizer {self.tokenizer[:12]}"

    def to_dict(self) -> dict[str, str]:
        return {"architecture": self.architecture, "tokenizer": self.tokenizer, "where": self.where}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> Fingerprint:
        return cls(
            architecture=str(data["architecture"]),
            tokenizer=str(data["tokenizer"]),
            where=str(data.get("where", "")),
        )

    def require_same(self, theirs: Fingerprint, what: str) -> None:
        """Raises ModelMismatch naming both models unless `theirs` is this one."""
        if theirs != self:
            raise ModelMismatch(
                f"{what} comes from another model ({theirs}) than this one ({self}): "
                "trainer and inference must start from the same model (model.dir, "
                "model.store_prefix)"
            )


def fingerprint(model_dir: Path) -> Fingerprint:
    """The model's architecture and tokenizer hashes (SHA-256, hex)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"{model_dir}: no config.json (not an HF-layout model)")
    config = json.loads(config_file.read_text())
    architecture = {k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE}
    tokenizer = hashlib.sha256()
    # A directory without tokenizer files (weights only) hashes as the empty set: it
    # matches no served model, which always has a tokenizer.
    for name in (name for name in TOKENIZER_FILES if (model_dir / name).is_file()):
        tokenizer.update(f"{name}\0".encode())
        tokenizer.update(hashlib.sha256((model_dir / name).read_bytes()).digest())
    return Fingerprint(
        architecture=hashlib.sha256(json.dumps(architecture, sort_keys=True).encode()).hexdigest(),
        tokenizer=tokenizer.hexdigest(),
        where=str(model_dir),
    )


def _files(model_dir: Path) -> list[Path]:
    return sorted(
        path.relative_to(model_dir)
        for path in model_dir.rglob("*")
        if path.is_file() and path.name != SOURCE_MARK
    )


def push_model(store: ObjectStore, model_dir: Path, prefix: str) -> int:
    """Uploads every file of `model_dir` under `prefix`, the file list last; returns bytes."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelSourceError(f"{model_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    fingerprint(model_dir)  # an HF-layout model, or refuse before uploading
    listing: dict[str, dict[str, int | str]] = {}
    total = 0
    for relative in _files(model_dir):
        data = (model_dir / relative).read_bytes()
        store.put(f"{prefix}/{relative.as_posix()}", data)
        listing[relative.as_posix()] = {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        total += len(data)
    store.put(f"{prefix}/{FILE_LIST}", json.dumps(listing, sort_keys=True, indent=1).encode())
    return total


def sync_model(store: ObjectStore, prefix: str, model_dir: Path) -> bool:
    """Brings the model under `prefix` into `model_dir` unless it holds it already; True
    when it downloaded. A directory holding another model (or one not synced from this
    prefix) is refused, never overwritten."""
    try:
        listing_bytes = store.get(f"{prefix}/{FILE_LIST}")
    except ObjectNotFound:
        raise ModelSourceError(
            f"model.store_prefix {prefix!r}: no {FILE_LIST} there; upload the model with "
            f"`etude model push --dir <model> --prefix {prefix}`"
        ) from None
    listing = json.loads(listing_bytes)
    mark = {"prefix": prefix, "files": hashlib.sha256(listing_bytes).hexdigest()}
    if model_dir.exists() and any(model_dir.iterdir()):
        held = model_dir / SOURCE_MARK
        if held.is_file() and json.loads(held.read_text()) == mark:
            return False
        raise ModelSourceError(
            f"model.dir {model_dir} exists but was not synced from {prefix!r} (or from an "
            "older upload); empty it, or unset model.store_prefix to use what it holds"
        )
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        for name, expected in sorted(listing.items()):
            data = store.get(f"{prefix}/{name}")
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != expected["size"] or digest != expected["sha256"]:
                raise ModelSourceError(f"{prefix}/{name}: size or SHA-256 differs from {FILE_LIST}")
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (staging / SOURCE_MARK).write_text(json.dumps(mark))
        os.chmod(staging, 0o755)
        try:
            staging.rename(model_dir)  # replaces an empty directory, never a full one
        except OSError:  # another rank or pod renamed its copy first: the same, or refused
            held = model_dir / SOURCE_MARK
            if not held.is_file() or json.loads(held.read_text()) != mark:
                raise
            return False
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return True
