"""Zip archives of repositories: safe extraction of uploads, and a release's repository layout."""

import io
import stat
import zipfile
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


def _inside_roots(path: Path, roots: list[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root.resolve()) for root in roots)


def release_archive(members: list[tuple[str, int, Any, str]], *, roots: list[Path]) -> bytes:
    """A loadable repository layout: (model, version, config, artifact) for each member. Artifact
    files are included only from a local directory inside one of `roots` (the model repositories
    this server may read; an artifact is free text), otherwise the location is named in ARTIFACT."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for model, version, config, artifact in members:
            archive.writestr(f"{model}/config.pbtxt", to_pbtxt(pin_versions(config, [version])))
            local = Path(artifact)
            if artifact and local.is_dir() and _inside_roots(local, roots):
                files = [p for p in local.rglob("*") if p.is_file() and not p.is_symlink()]
                for path in sorted(p for p in files if "__pycache__" not in p.parts):
                    archive.write(path, f"{model}/{version}/{path.relative_to(local)}")
            else:
                archive.writestr(f"{model}/{version}/ARTIFACT", f"{artifact or 'not recorded'}\n")
    return buffer.getvalue()
