"""Zip archives of repositories: safe extraction of uploads, and a release's repository layout."""

import io
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from apps.registry.codec import pin_versions, to_pbtxt

MAX_MEMBERS = 2_000
MAX_UNPACKED_BYTES = 200 * 1024 * 1024
# Model files and configs compress a few times at most; a far higher ratio is a zip bomb.
MAX_COMPRESSION_RATIO = 50


class ArchiveError(ValueError):
    pass


MAX_UPLOAD_BYTES = 20 * 1024 * 1024


def extract_repository(data: bytes, target: Path) -> Path:
    """Unpack an uploaded zip into `target`, refusing anything that could escape it or blow up;
    returns the repository root (the archive's single top directory, if it has one)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise ArchiveError(f"not a zip archive: {exc}") from exc
    members = archive.infolist()
    if len(members) > MAX_MEMBERS:
        raise ArchiveError(f"{len(members)} entries: more than {MAX_MEMBERS}")
    unpacked = sum(m.file_size for m in members)
    if unpacked > MAX_UNPACKED_BYTES:
        raise ArchiveError(f"unpacks to more than {MAX_UNPACKED_BYTES // 2**20} MiB")
    if unpacked > 2**20 and unpacked > MAX_COMPRESSION_RATIO * len(data):
        raise ArchiveError(
            f"unpacks {len(data):,} bytes to {unpacked:,}: more than {MAX_COMPRESSION_RATIO}"
            " times its size, which no model repository does"
        )
    for member in members:
        path = PurePosixPath(member.filename)
        if path.is_absolute() or ".." in path.parts or "\\" in member.filename:
            raise ArchiveError(f"{member.filename}: path leaves the archive")
        if stat.S_ISLNK(member.external_attr >> 16):
            raise ArchiveError(f"{member.filename}: symbolic links are not accepted")
    try:
        archive.extractall(target)  # every member was checked above
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ArchiveError(f"the archive is damaged: {exc}") from exc
    entries = [p for p in target.iterdir() if not p.name.startswith(("__MACOSX", "."))]
    if len(entries) == 1 and entries[0].is_dir() and not (entries[0] / "config.pbtxt").exists():
        return entries[0]
    return target


def inside_roots(path: Path, roots: list[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root.resolve()) for root in roots)


# What a release download may hold, uncompressed: a model's weights can be large, but a download
# must never fill the web process's memory or disk (it is streamed, and refused past this).
MAX_RELEASE_BYTES = 4 * 2**30

Member = tuple[str, int, Any, str]  # model, version, config, artifact


def release_archive(members: list[Member], *, roots: list[Path]) -> Iterator[bytes]:
    """A loadable repository layout, streamed: (model, version, config, artifact) for each
    member. Artifact files are included only from a local directory inside one of `roots` (the
    model repositories this server may read; an artifact is free text), otherwise the location
    is named in ARTIFACT. Raises ArchiveError, before anything is sent, past MAX_RELEASE_BYTES."""
    files: list[list[Path] | None] = []
    for _, _, _, artifact in members:
        local = Path(artifact)
        if not (artifact and local.is_dir() and inside_roots(local, roots)):
            files.append(None)
            continue
        found = (p for p in local.rglob("*") if p.is_file() and not p.is_symlink())
        files.append(sorted(p for p in found if "__pycache__" not in p.parts))
    total = sum(path.stat().st_size for each in files for path in each or [])
    if total > MAX_RELEASE_BYTES:
        raise ArchiveError(
            f"the release's files hold {total / 2**20:,.0f} MiB, more than the "
            f"{MAX_RELEASE_BYTES // 2**20:,} MiB a download may: copy them from the repository"
        )
    return _written(list(zip(members, files, strict=True)))


class _Sink(io.RawIOBase):
    """Where the archive is written: what was written since it was last taken."""

    def __init__(self) -> None:
        self.written = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.written += data
        return len(data)

    def take(self) -> bytes:
        taken = bytes(self.written)
        self.written.clear()
        return taken


def _written(planned: list[tuple[Member, list[Path] | None]]) -> Iterator[bytes]:
    sink = _Sink()  # not seekable: zipfile writes each member's sizes after its data
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_DEFLATED) as archive:
        for (model, version, config, artifact), files in planned:
            archive.writestr(f"{model}/config.pbtxt", to_pbtxt(pin_versions(config, [version])))
            if files is None:
                archive.writestr(f"{model}/{version}/ARTIFACT", f"{artifact or 'not recorded'}\n")
            for path in files or []:
                archive.write(path, f"{model}/{version}/{path.relative_to(artifact)}")
                yield sink.take()
            yield sink.take()
    yield sink.take()
