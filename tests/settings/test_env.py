"""The one REVISIT_* loader: typed reads, the caller's error naming the variable, dataclass fields by type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from settings import EnvReader, SettingsError


class PartError(ValueError):
    pass


def test_typed_reads_and_defaults() -> None:
    env = EnvReader({"R_INT": "7", "R_FLOAT": "0.5", "R_BOOL": "yes", "R_PATH": "~/x", "R_CSV": "a, b,,c",
                     "R_JSON": '{"k": "v"}', "R_EMPTY": ""})
    assert env.integer("R_INT") == 7 and env.number("R_FLOAT") == 0.5 and env.flag("R_BOOL") is True
    assert env.path("R_PATH") == Path.home() / "x"
    assert env.csv("R_CSV") == ("a", "b", "c")
    assert env.json("R_JSON") == {"k": "v"}
    assert env.integer("R_MISSING", 3) == 3
    assert env.integer("R_EMPTY", 4) == 4  # an empty variable counts as unset


@pytest.mark.parametrize(("name", "read"), [("R_X", "integer"), ("R_X", "number"), ("R_X", "flag"), ("R_X", "json")])
def test_a_bad_value_raises_the_callers_error_naming_the_variable(name: str, read: str) -> None:
    env = EnvReader({name: "{not"}, error=PartError)
    with pytest.raises(PartError, match=r"^R_X='{not' is not a valid"):
        getattr(env, read)(name)


def test_default_error_is_settings_error() -> None:
    with pytest.raises(SettingsError):
        EnvReader({"R_X": "maybe"}).flag("R_X")


@dataclass(frozen=True, kw_only=True)
class Part:
    size: int = 1
    ratio: float = 0.5
    on: bool = True
    where: Path | None = None
    names: tuple[str, ...] = ()
    label: str = "x"


def test_fields_reads_each_field_by_its_type() -> None:
    env = EnvReader({"P_SIZE": "9", "P_RATIO": "0.25", "P_ON": "0", "P_WHERE": "/tmp/p", "P_NAMES": "a,b",
                     "P_LABEL": "y", "OTHER": "ignored"})
    assert Part(**env.fields(Part, "P_")) == Part(size=9, ratio=0.25, on=False, where=Path("/tmp/p"),
                                                  names=("a", "b"), label="y")
    assert Part(**EnvReader({"P_SIZE": ""}).fields(Part, "P_")) == Part()


def test_fields_refuses_a_variable_that_names_no_field() -> None:
    with pytest.raises(PartError, match="unknown variable P_SIZ"):
        EnvReader({"P_SIZ": "1"}, error=PartError).fields(Part, "P_")
