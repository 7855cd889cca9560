"""Reads a Triton model repository on disk: one directory per model, numeric version subdirectories.

A version directory may carry its own `config.pbtxt`, which overrides the model's for that version:
this is how the demo repository ships ensemble versions whose wiring differs (Triton itself ignores
the file and only ever sees the config the control plane sends with the load request).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apps.registry.codec import parse_pbtxt


@dataclass(frozen=True)
class RepositoryModel:
    name: str
    path: Path
    configs: dict[int, Any]  # version -> ModelConfig

    @property
    def versions(self) -> list[int]:
        return sorted(self.configs)


def read_model(repository: Path, name: str) -> RepositoryModel:
    path = repository / name
    config_file = path / "config.pbtxt"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: no such model config in repository {repository}")
    default = parse_pbtxt(config_file.read_text(), source=str(config_file))
    configs = {}
    for entry in sorted(path.iterdir()):
        # Version folders are ASCII digits, as Triton reads them ("²" is a digit to Python).
        if entry.is_dir() and entry.name.isascii() and entry.name.isdigit():
            override = entry / "config.pbtxt"
            configs[int(entry.name)] = (
                parse_pbtxt(override.read_text(), source=str(override))
                if override.is_file()
                else default
            )
    return RepositoryModel(name=name, path=path, configs=configs)


def read_repository(repository: Path) -> list[RepositoryModel]:
    return [
        read_model(repository, entry.name)
        for entry in sorted(repository.iterdir())
        if (entry / "config.pbtxt").is_file()
    ]
