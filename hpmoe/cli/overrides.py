"""``--set FIELD=VALUE``: command-line overrides of a hardware model's numeric fields."""

from __future__ import annotations

from dataclasses import fields, replace

from ..sim.hardware import HardwareModel

OVERRIDE_ALIASES = {"hbm_gbs": ("mem_bw", 1e9), "stream_gbs": ("stream_bw", 1e9),
                    "inter_link_gbs": ("inter_link_bw", 1e9),
                    "host_mem_gbs": ("host_mem_bw", 1e9), "link_latency_us": ("link_latency", 1e-6),
                    "inter_latency_us": ("inter_latency", 1e-6), "task_overhead_us": ("task_overhead", 1e-6)}


def override_fields() -> tuple[str, ...]:
    """Every name ``with_overrides`` accepts: numeric fields and ``OVERRIDE_ALIASES``."""
    numeric = [f.name for f in fields(HardwareModel) if f.type in ("int", "float")]
    return tuple(sorted([*numeric, *OVERRIDE_ALIASES]))


def with_overrides(model: HardwareModel, assignments: list[str] | tuple[str, ...]) -> HardwareModel:
    """``model`` with each ``"FIELD=VALUE"`` of ``assignments`` applied, in order, e.g.
    ``["l2_mb=0", "hbm_gbs=800"]``.  ValueError naming the valid fields for an unknown one,
    and the field's own check for a bad value."""
    changes: dict[str, float | int] = {}
    for item in assignments:
        name, sep, text = str(item).partition("=")
        name = name.strip()
        if not sep or name not in override_fields():
            raise ValueError(f"--set {item!r}: unknown hardware field {name!r}; valid fields: "
                             f"{', '.join(override_fields())}")
        try:
            value = float(text)
        except ValueError as err:
            raise ValueError(f"--set {item!r}: {text!r} is not a number") from err
        field_name, factor = OVERRIDE_ALIASES.get(name, (name, 1.0))
        kind = next(f.type for f in fields(HardwareModel) if f.name == field_name)
        if kind == "int":
            if value != int(value):
                raise ValueError(f"--set {item!r}: {field_name} must be an integer")
            changes[field_name] = int(value)
        else:
            changes[field_name] = value * factor
    return replace(model, **changes)
