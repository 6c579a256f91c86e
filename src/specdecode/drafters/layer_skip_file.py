"""Which layers self-speculation skips, as a user gives them: a list (``--skip-layers 4-9,12``),
a file ``specdecode tune-layerskip`` wrote (``LayerSkipChoice``), or the choice shipped for a demo
target; validated against the target's layer count. The drafter (``layer_skip.py``) and the
search (``training/layer_search.py``) both read this module; it reads neither.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.errors import InvalidRequestError


def check_skip_layers(skip_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Sorted, validated layer indices to skip."""
    skip = tuple(sorted(set(skip_layers)))
    if not skip:
        raise InvalidRequestError("layer skip needs at least one layer to skip.")
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise InvalidRequestError(f"layers to skip must lie in 0..{num_layers - 1}; got {bad}.")
    if len(skip) >= num_layers:
        raise InvalidRequestError("layer skip must keep at least one layer.")
    return skip


CHOICE_SCHEMA = 1


@dataclass(slots=True)
class LayerSkipChoice:
    """The layers a target skips when it drafts for itself, with the measurements behind it."""

    target: str
    num_layers: int
    skip_layers: tuple[int, ...]
    measured: dict[str, Any] = field(default_factory=dict)
    schema: int = CHOICE_SCHEMA

    def save(self, path: Path) -> None:
        data = asdict(self)
        data["skip_layers"] = list(self.skip_layers)
        path.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, num_layers: int | None = None) -> LayerSkipChoice:
        """Read a saved choice; with ``num_layers``, check it fits the model it is used with."""
        try:
            data = json.loads(Path(path).read_text())
            choice = cls(
                target=str(data["target"]),
                num_layers=int(data["num_layers"]),
                skip_layers=tuple(int(i) for i in data["skip_layers"]),
                measured=dict(data.get("measured", {})),
                schema=int(data.get("schema", CHOICE_SCHEMA)),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(f"Cannot read the layer-skip choice {path}: {exc}") from exc
        if num_layers is not None and choice.num_layers != num_layers:
            raise InvalidRequestError(
                f"{path} was tuned for a {choice.num_layers}-layer model ({choice.target}); this target has "
                f"{num_layers} layers. Run `specdecode tune-layerskip` for it."
            )
        check_skip_layers(choice.skip_layers, choice.num_layers)
        return choice


BUILTIN_DIR = "data"  # package data: tuned choices for the demo targets, <demo name>.layerskip.json


def builtin_choice(target: str) -> LayerSkipChoice | None:
    """The choice shipped for a demo target (tuned with ``specdecode tune-layerskip``), if any."""
    from importlib import resources

    from specdecode.models import demo

    name = demo.canonical_demo_name(target)
    if name is None:
        return None
    resource = resources.files("specdecode").joinpath(BUILTIN_DIR, f"{name}.layerskip.json")
    if not resource.is_file():
        return None
    with resources.as_file(resource) as path:
        return LayerSkipChoice.load(path)


def parse_skip_layers(text: str) -> tuple[int, ...]:
    """'3,5,7-9' -> (3, 5, 7, 8, 9)."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            first, dash, last = part.partition("-")
            layers += range(int(first), int(last) + 1) if dash else [int(first)]
    except ValueError as exc:
        raise InvalidRequestError(f"skip_layers={text!r}: give indices and ranges like '3,5,7-9'.") from exc
    return tuple(layers)


def resolve_skip_layers(
    target: str, num_layers: int, skip_layers: Sequence[int] | None, layerskip_config: str | Path | None
) -> tuple[int, ...]:
    """The layers layer skip drops: given explicitly, from a tune-layerskip file, or the demo target's built-in choice."""
    if skip_layers and layerskip_config:
        raise InvalidRequestError("Give the layers to skip either as skip_layers= or as layerskip_config=, not both.")
    if skip_layers:
        return check_skip_layers(skip_layers, num_layers)
    if layerskip_config:
        return LayerSkipChoice.load(Path(layerskip_config), num_layers).skip_layers
    builtin = builtin_choice(target)
    if builtin is None:
        raise InvalidRequestError(
            f'method="layerskip" needs the layers to skip for {target}: run `specdecode tune-layerskip --target '
            f'{target} --out layerskip.json` and pass layerskip_config="layerskip.json", or give skip_layers=.'
        )
    return check_skip_layers(builtin.skip_layers, num_layers)
