"""The model store: one Hugging Face style directory per model under models_root().

Every write goes through `ModelStore.staging`: files land in `.tmp-<name>-<pid>-*`
inside the root, are validated and fsynced, and only then renamed into place, so
a pull or import killed half way leaves no half model. Readers skip dot entries;
the next write removes temp dirs whose process is gone. No torch here: the CLI
imports this module and must start fast.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from gpuservd.errors import ModelNotFound, StoreCorrupt, UserError
from gpuservd.paths import models_root
from gpuservd.store import layout, variant
from gpuservd.store.fsutil import clean_stale_tmp, fsync_path, fsync_tree, set_default_modes, tmp_name

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
MAX_NAME_LEN = 64  # a name is a directory name and appears in temp names; keep it well under 255
META_FILE = "gpuserv.yaml"
# Files an import never copies: other weight formats (we load safetensors only),
# and our own metadata, which is rewritten for the new entry.
_SKIP_SUFFIXES = (".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx", ".ckpt")


@dataclass
class ModelInfo:
    """One store entry as the CLI, the API and the engine see it."""

    name: str  # directory name under the store root
    path: Path  # absolute path of the model directory
    architecture: str  # config.json architectures[0], e.g. LlamaForCausalLM
    num_parameters: int  # elements stored in the safetensors files (tied lm_head counted once)
    dtype: str  # torch dtype name of the stored weights, e.g. float32
    bytes_on_disk: int  # all files of the entry
    num_layers: int  # config num_hidden_layers
    hidden_size: int  # config hidden_size
    num_kv_heads: int  # config num_key_value_heads (defaults to num_attention_heads)
    max_position_embeddings: int  # config max_position_embeddings (0 when absent)
    source: str  # where it came from (gpuserv.yaml), "unknown" for hand-placed dirs
    created: str = ""  # ISO time of the pull/import (gpuserv.yaml), "" when unknown
    error: str | None = None  # set by list() for a damaged entry; the other fields are then partial
    base: str | None = None  # a variant's base model (its weights shared); None for a full model
    variant_kind: str | None = None  # lora | delta for a variant; None for a full model


def validate_name(name: str) -> None:
    """Raise UserError unless name matches [a-z0-9][a-z0-9._-]* (at most 64 characters)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or len(name) > MAX_NAME_LEN:
        raise UserError(
            f"invalid model name {name!r}: use lower-case letters, digits, '.', '_' and '-', "
            f"starting with a letter or digit, at most {MAX_NAME_LEN} characters"
        )


def _import_target(file: Path, src: Path) -> Path:
    """The file an import copies for `file`: itself, or, for a symlink, its target, which must stay
    inside the source directory (or, for a Hugging Face cache snapshot, inside the repository's
    `blobs/`). A link out of there (README.md -> /etc/shadow) is refused: the store would otherwise
    hold, readable, a file the importing user was only meant to point at."""
    if not file.is_symlink():
        return file
    target = file.resolve()
    allowed = [src]
    if src.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<rev>/config.json -> ../../blobs/x
        allowed.append(src.parent.parent / "blobs")
    if not any(target.is_relative_to(a) for a in allowed):
        raise UserError(f"{file} is a symlink to {target}, outside {src}; copy the file in (or remove the link) "
                        "and import again")
    return target


def _write_error(exc: OSError, root: Path, name: str) -> UserError:
    """A failed store write as one line (ENOSPC, EACCES, EROFS...)."""
    where = exc.filename or root
    return UserError(f"cannot write model {name!r} into the store {root}: {exc.strerror or exc} ({where}); "
                     "nothing was published")


def _copy_file(src: Path, dst: Path) -> None:
    """Copy one file during an import (a seam tests patch to simulate a crash)."""
    shutil.copyfile(src, dst)


class ModelStore:
    """The model directories under `root` (default: models_root(), i.e. $GPUSERV_HOME/models)."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else models_root()

    # ---- reading -------------------------------------------------------------

    def names(self) -> list[str]:
        """Names of the entries present, sorted; temp and hidden dirs are skipped."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def list(self) -> list[ModelInfo]:
        """Every entry; a damaged one is listed with `error` set rather than hidden."""
        return [self._entry(name) for name in self.names()]

    def entry(self, name: str) -> ModelInfo:
        """One entry as list() shows it: its info, or, when damaged, what is known with `error` set."""
        self.path(name)
        return self._entry(name)

    def _entry(self, name: str) -> ModelInfo:
        try:
            return self._read_info(name, self.root / name)
        except StoreCorrupt as exc:
            return self._broken_info(name, str(exc))
        except (OSError, UserError, ValueError, TypeError, KeyError) as exc:
            # One unreadable or hand-edited entry must not hide the rest of the store.
            return self._broken_info(name, f"{self.root / name}: {type(exc).__name__}: {exc}")

    def path(self, name: str) -> Path:
        """The directory of a model; ModelNotFound (naming what is present) if absent."""
        validate_name(name)
        model_dir = self.root / name
        if not model_dir.is_dir():
            present = ", ".join(self.names()) or "none"
            raise ModelNotFound(
                f"model {name!r} is not in the store {self.root} (present: {present}); "
                "run `gpuserv pull smollm2` for the default model, "
                "or `gpuserv models import PATH --name NAME`"
            )
        return model_dir

    def info(self, name: str) -> ModelInfo:
        """Metadata of one entry, from config.json, the safetensors headers and gpuserv.yaml."""
        return self._read_info(name, self.path(name))

    def check(self, name: str) -> ModelInfo:
        """Validate an entry (config fields, every weight shard, tokenizer.json).

        Raises StoreCorrupt naming the exact bad file; returns the entry's info when sound.
        """
        model_dir = self.path(name)
        meta = self._read_meta(model_dir)
        if meta.get("kind") in variant.KINDS and meta.get("base"):
            return self._read_variant_info(name, model_dir, meta, validate=True)
        layout.check_dir(model_dir)
        return self._read_info(name, model_dir)

    def variant_meta(self, name: str) -> dict | None:
        """A variant's gpuserv.yaml ({kind, base, ...}); None for a full model."""
        meta = self._read_meta(self.path(name))
        return meta if meta.get("kind") in variant.KINDS and meta.get("base") else None

    def base_dir(self, name: str) -> Path:
        """Where a model's config.json and tokenizer live: its own directory, or its base's."""
        meta = self.variant_meta(name)
        return self.path(meta["base"]) if meta else self.path(name)

    def variants_of(self, base: str) -> list[str]:
        """The store entries declared as variants of `base`."""
        metas = {n: self._read_meta(self.root / n) for n in self.names()}
        return [n for n, m in metas.items() if m.get("base") == base and m.get("kind") in variant.KINDS]

    def _read_variant_info(self, name: str, model_dir: Path, meta: dict, validate: bool = False) -> ModelInfo:
        base = str(meta["base"])
        if base not in self.names():
            raise StoreCorrupt(f"{model_dir / META_FILE}: base model {base!r} is not in the store")
        config = layout.read_config(self.root / base)
        if validate:
            spec = variant.validate_delta(model_dir, config, base)
            num_parameters, dtype = spec.num_parameters, spec.dtype
        else:
            num_parameters, dtype = int(meta.get("num_parameters") or 0), str(meta.get("dtype", "?"))
        return ModelInfo(
            name=name, path=model_dir.resolve(), architecture=layout.architecture_of(config),
            num_parameters=num_parameters, dtype=dtype, bytes_on_disk=layout.dir_bytes(model_dir),
            num_layers=int(config["num_hidden_layers"]), hidden_size=int(config["hidden_size"]),
            num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            source=str(meta.get("source", "unknown")), created=str(meta.get("created", "")),
            base=base, variant_kind=str(meta["kind"]))

    def _read_info(self, name: str, model_dir: Path) -> ModelInfo:
        meta = self._read_meta(model_dir)
        if meta.get("kind") in variant.KINDS and meta.get("base"):
            return self._read_variant_info(name, model_dir, meta)
        config = layout.read_config(model_dir)
        summary = layout.summarize_weights(model_dir)
        meta = self._read_meta(model_dir)
        return ModelInfo(
            name=name,
            path=model_dir.resolve(),
            architecture=layout.architecture_of(config),
            num_parameters=summary.num_parameters,
            dtype=summary.dtype,
            bytes_on_disk=layout.dir_bytes(model_dir),
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            source=str(meta.get("source", "unknown")),
            created=str(meta.get("created", "")),
        )

    def _broken_info(self, name: str, error: str) -> ModelInfo:
        # What gpuserv.yaml remembers fills in for the files that cannot be read.
        model_dir = self.root / name
        meta = self._read_meta(model_dir)

        def number(key: str) -> int:
            value = meta.get(key)
            return value if isinstance(value, int) else 0

        return ModelInfo(
            name=name, path=model_dir.resolve(), architecture=str(meta.get("architecture", "?")),
            num_parameters=number("num_parameters"), dtype=str(meta.get("dtype", "?")),
            bytes_on_disk=layout.dir_bytes(model_dir), num_layers=number("num_layers"),
            hidden_size=0, num_kv_heads=0, max_position_embeddings=0,
            source=str(meta.get("source", "unknown")), created=str(meta.get("created", "")), error=error,
        )

    @staticmethod
    def _read_meta(model_dir: Path) -> dict:
        # gpuserv.yaml is informative only; a hand-placed HF dir without one is still a model.
        try:
            meta = yaml.safe_load((model_dir / META_FILE).read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return meta if isinstance(meta, dict) else {}

    # ---- writing -------------------------------------------------------------

    @contextmanager
    def staging(self, name: str, source: str, overwrite: bool = False, validate=None,
                modes: dict[str, int] | None = None) -> Iterator[Path]:
        """Yield an empty temp dir inside the root; on clean exit, publish it as `name`.

        Publishing validates the directory (layout.check_dir), writes gpuserv.yaml,
        fsyncs every file and renames the dir into place. Any exception (or a kill)
        leaves no entry behind: the temp dir is removed now, or by the next write.
        validate(tmp) -> gpuserv.yaml's dict replaces check_dir for entries that are not full
        models (variants). modes: file name -> permission bits to narrow that file to (an import
        keeps a source file's narrower mode). A full disk or a permission error is a one-line
        UserError naming the store.
        """
        validate_name(name)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.clean_stale()
            dest = self.root / name
            if dest.exists() and not overwrite:
                raise UserError(f"model {name!r} already exists in {self.root}; pass --overwrite to replace it")
            tmp = self.root / tmp_name(name)
            tmp.mkdir(mode=0o700)
        except OSError as exc:
            raise _write_error(exc, self.root, name) from None
        try:
            yield tmp
            if validate is not None:
                (tmp / META_FILE).write_text(yaml.safe_dump(validate(tmp), sort_keys=False))
            else:
                config, summary = layout.check_dir(tmp)
                self._write_meta(tmp, name, source, config, summary)
            set_default_modes(tmp, modes)
            fsync_tree(tmp)
            self._publish(tmp, dest, overwrite)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_error(exc, self.root, name) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write_meta(self, tmp: Path, name: str, source: str, config: dict, summary) -> None:
        meta = {
            "name": name,
            "source": source,
            "architecture": layout.architecture_of(config),
            "dtype": summary.dtype,
            "num_parameters": summary.num_parameters,
            "num_layers": int(config["num_hidden_layers"]),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / META_FILE).write_text(yaml.safe_dump(meta, sort_keys=False))

    def _publish(self, tmp: Path, dest: Path, overwrite: bool) -> None:
        old = None
        if dest.exists() and overwrite:
            # Move the old entry aside first: os.rename cannot replace a non-empty dir.
            old = self.root / tmp_name(dest.name)
            os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except OSError as exc:
            if old is not None:
                os.rename(old, dest)
            raise UserError(f"model {dest.name!r} appeared in {self.root} meanwhile ({exc}); try again") from None
        fsync_path(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def clean_stale(self) -> list[Path]:
        """Remove temp dirs left in the root by processes that are gone; return them."""
        return clean_stale_tmp(self.root)

    def import_dir(self, src: Path, name: str, overwrite: bool = False) -> ModelInfo:
        """Copy a local Hugging Face Llama/Mistral/Qwen2 directory into the store, atomically.

        Copies the top-level files (config, tokenizer files, *.safetensors, ...), not
        subdirectories nor other weight formats (.bin, .gguf, ...).
        """
        validate_name(name)
        src = Path(src).expanduser().resolve()
        if not src.is_dir():
            raise UserError(f"{src}: not a directory")
        files = [
            p for p in sorted(src.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != META_FILE
            and not p.name.endswith(_SKIP_SUFFIXES)
        ]
        targets = {f.name: _import_target(f, src) for f in files}  # before any file is read
        config = layout.read_config(src)
        layout.require_supported(config, src / "config.json")
        layout.summarize_weights(src)  # every shard present and readable
        if not (src / layout.TOKENIZER_FILE).is_file():
            raise UserError(f"{src / layout.TOKENIZER_FILE}: missing (a fast tokenizer is required)")
        # A copy is never more readable than its source (a 0600 file stays 0600 in the store).
        modes = {n: t.stat().st_mode & 0o644 for n, t in targets.items()}
        with self.staging(name, source=f"import:{src}", overwrite=overwrite, modes=modes) as tmp:
            for file_name, target in targets.items():
                _copy_file(target, tmp / file_name)
        return self.info(name)

    def derive(self, name: str, base: str, adapter: Path, overwrite: bool = False) -> ModelInfo:
        """Register a variant: `base` plus a LoRA adapter or full-rank delta from `adapter`,
        validated against the base's shapes; only the delta's files are copied."""
        validate_name(name)
        if name == base:
            raise UserError(f"a variant cannot be its own base ({name!r})")
        base_dir = self.path(base)
        if self.variant_meta(base):
            raise UserError(f"{base!r} is itself a variant; derive from a full model ({self.variant_meta(base)['base']})")
        adapter = Path(adapter).expanduser().resolve()
        if not adapter.is_dir():
            raise UserError(f"{adapter}: not a directory")
        base_config = layout.read_config(base_dir)
        spec = variant.validate_delta(adapter, base_config, base)  # fail before anything is written

        def meta(tmp: Path) -> dict:
            variant.validate_delta(tmp, base_config, base)  # the copies, as they will be served
            return {"name": name, "source": f"derive:{adapter}", "kind": spec.kind, "base": base,
                    "architecture": layout.architecture_of(base_config), "dtype": spec.dtype,
                    "num_parameters": spec.num_parameters, "num_layers": int(base_config["num_hidden_layers"]),
                    "rank": spec.rank, "lora_alpha": spec.alpha, "targets": spec.targets,
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}

        with self.staging(name, source=f"derive:{adapter}", overwrite=overwrite, validate=meta) as tmp:
            for f in spec.files:
                _copy_file(adapter / f, tmp / f)
        return self.info(name)

    def remove(self, name: str) -> None:
        """Delete an entry; it vanishes at once (renamed aside) and is then deleted."""
        model_dir = self.path(name)
        dependents = self.variants_of(name)
        if dependents:
            raise UserError(f"model {name!r} is the base of {', '.join(dependents)}; remove those first")
        aside = self.root / tmp_name(name)
        os.rename(model_dir, aside)
        shutil.rmtree(aside, ignore_errors=True)
