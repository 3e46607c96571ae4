"""The options serve, generate and smoke share are declared once (agent.cli.options): every command that
takes a group lists each of its flags with the same help, a field added to a group reaches every such
command, a command's own defaults hold, and the command receives the filled-in group."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import typer
from typer.testing import CliRunner

from agent.cli import app
from agent.cli.options import BoardOptions, EdgeOptions, ExitOptions, ModelOptions, opt, options, shared_options

USERS = {"generate": (ModelOptions, ExitOptions, EdgeOptions), "serve": (ModelOptions, ExitOptions, EdgeOptions,
                                                                      BoardOptions),
         "smoke": (BoardOptions,)}


def _params(name: str) -> dict[str, typer.core.TyperOption]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


@pytest.mark.parametrize("name", sorted(USERS))
def test_each_command_lists_every_flag_of_its_groups(name: str) -> None:
    params = _params(name)
    for group in USERS[name]:
        for f in dataclasses.fields(group):
            p = params[f.name]
            assert tuple(p.opts) == f.metadata["decls"], (name, f.name)
            assert p.help.startswith(f.metadata["help"]), (name, f.name)  # a command may add a sentence
            assert p.envvar == f.metadata["envvar"]


def test_the_flags_and_defaults_the_commands_had_before_stay() -> None:
    """generate's defaults are its own (backend auto since partition/runners/backend_choice.py); serve's are None."""
    gen, serve, smoke = _params("generate"), _params("serve"), _params("smoke")
    assert {n: gen[n].default for n in ("model", "backend", "kv_cache", "kv_blocks", "device_layers",
                                        "edge_token", "link_dtype", "edge")} == {
        "model": gen["model"].default, "backend": "auto", "kv_cache": "fp16", "kv_blocks": None,
        "device_layers": "4", "edge_token": "", "link_dtype": "fp16", "edge": None}
    assert str(gen["model"].default).endswith("models/stdlib-llama-8l")
    # serve leaves every shared option unset (None), so the config file decides
    assert all(serve[f.name].default is None for g in USERS["serve"] for f in dataclasses.fields(g))
    assert smoke["root"].default == "/"
    assert gen["edge_token"].envvar == serve["edge_token"].envvar == "ORIN_AGENT_EDGE_TOKEN"


@dataclass(frozen=True)
class _Demo:
    size: Optional[int] = opt("--size", help="A size.")
    label: Optional[str] = opt("--label", help="A label.")


def test_the_command_gets_the_group_filled_in_with_its_defaults() -> None:
    seen: list[object] = []

    @shared_options
    def cmd(first: int = typer.Option(1, "--first"), demo: _Demo = options(_Demo, size=3),
            last: bool = typer.Option(False, "--last")) -> None:
        seen.append((first, demo, last))

    demo_app = typer.Typer()
    demo_app.command()(cmd)
    demo_app.command("other")(lambda: None)
    runner = CliRunner()
    assert runner.invoke(demo_app, ["cmd"]).exit_code == 0
    assert runner.invoke(demo_app, ["cmd", "--label", "x", "--size", "5", "--last"]).exit_code == 0
    assert seen == [(1, _Demo(size=3, label=None), False), (1, _Demo(size=5, label="x"), True)]
    help_text = runner.invoke(demo_app, ["cmd", "--help"]).output
    assert "--size" in help_text and "--label" in help_text and "A label." in help_text


def test_a_default_or_note_for_an_option_the_group_lacks_is_refused() -> None:
    with pytest.raises(TypeError, match="no option colour"):
        options(_Demo, colour="red")
    with pytest.raises(TypeError, match="no option colour"):
        options(_Demo, notes={"colour": "Red."})


def test_an_option_declared_twice_is_refused() -> None:
    with pytest.raises(TypeError, match="'size' is declared twice"):
        @shared_options
        def cmd(demo: _Demo = options(_Demo), size: int = typer.Option(1, "--size")) -> None: ...
