"""The base of the coordinator's typed records (an evacuation's state, a snapshot's record).

Shape on the wire and in the database: `model_dump(by_alias=True, exclude_unset=True)`, so a field
appears once something set it, exactly as the records looked before they were typed, and an
operator's tools reading them see no difference."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    # Keys an older or newer release wrote that this one does not know are kept as they are:
    # an upgrade or a downgrade never truncates a record an operator may still need to read.
    model_config = ConfigDict(extra="allow", validate_assignment=True, populate_by_name=True)
    # Fields every record of the type is written with, set or not: what it is and its version.
    # Left to each constructor, a record made without them lost them in its dump (a recovery
    # without its @type was taken for an evacuation).
    always: ClassVar[tuple[str, ...]] = ()

    def model_post_init(self, context: Any) -> None:
        self.model_fields_set.update(self.always)

    def unset(self, name: str) -> None:
        """Take a field out of the record again (its default, and absent from the dump)."""
        setattr(self, name, type(self).model_fields[name].get_default(call_default_factory=True))
        self.model_fields_set.discard(name)

    def dump(self) -> dict[str, Any]:
        mark_changed(self)
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")


def mark_changed(m: BaseModel) -> None:
    """Count as set every field whose value is no longer its default: a default list or dict
    changed in place (`phases[p] = s`) never passes through __setattr__, and would otherwise be
    left out of the dump."""
    for name, f in type(m).model_fields.items():
        value = getattr(m, name)
        if name not in m.model_fields_set and value != f.get_default(call_default_factory=True):
            m.model_fields_set.add(name)
        for v in (value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]):
            if isinstance(v, BaseModel):
                mark_changed(v)
