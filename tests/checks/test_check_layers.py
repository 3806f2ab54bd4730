"""scripts/check_layers.py: the core's modules import downward only. Run over the real core
(so `make test` fails on a new cycle) and over small trees it must judge right."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import check_layers  # noqa: E402


def tree(tmp_path, files):
    src = tmp_path / "src"
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return src


def test_the_core_has_no_cycle_but_those_listed():
    run = subprocess.run([sys.executable, str(ROOT / "scripts/check_layers.py")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_a_cycle_through_a_folder_is_caught(tmp_path):
    src = tree(tmp_path, {
        "lib.rs": "pub mod a; pub mod b; pub mod providers;",
        "a.rs": "use crate::b::Thing;\n",
        "b.rs": "pub fn f() { crate::providers::gemini::route(\"\"); }\n",
        "providers/mod.rs": "pub mod gemini;\n",
        # `super::super::a` from providers::gemini is crate::a: the cycle a -> b -> providers -> a.
        "providers/gemini.rs": "use super::super::a;\npub fn route(_: &str) {}\n",
    })
    assert check_layers.cycles(check_layers.graph(src)) == [["a", "b", "providers"]]
    assert check_layers.check(src, set()) == ["import cycle: a b providers (layers must import downward only)"]
    # Listed, it passes; once broken, the stale entry fails.
    assert check_layers.check(src, {"a b providers"}) == []
    (src / "providers/gemini.rs").write_text("pub fn route(_: &str) {}\n")
    assert check_layers.check(src, {"a b providers"}) == ["a b providers: listed in layer_cycles.txt but gone; remove it"]


def test_grouped_uses_count_and_tests_and_comments_do_not(tmp_path):
    src = tree(tmp_path, {
        "a.rs": "use crate::{b::X, c};\n",
        "b.rs": "// crate::a is only mentioned\n#[cfg(test)]\nmod tests {\n    use crate::a::Y;\n}\n",
        "c.rs": "",
        "b_tests.rs": "use crate::a::Z;\n",
    })
    assert check_layers.graph(src) == {"a": {"b", "c"}, "b": set(), "c": set()}
    assert check_layers.cycles(check_layers.graph(src)) == []
    (src / "c.rs").write_text("use crate::a;\n")
    assert check_layers.cycles(check_layers.graph(src)) == [["a", "c"]]


DRAWN = """//! The layers.
//!
//! ```text
//! top           uses both below
//! middle        uses base
//!                 (a continued line)
//! base          imports nothing
//! ```
pub mod base; pub mod middle; pub mod top;
"""


def test_the_order_is_read_from_the_drawing_in_lib_rs(tmp_path):
    src = tree(tmp_path, {"lib.rs": DRAWN, "base.rs": "", "middle.rs": "", "top.rs": ""})
    assert check_layers.layers(src) == [["base"], ["middle"], ["top"]]


def test_an_upward_import_fails_and_downward_ones_pass(tmp_path):
    src = tree(tmp_path, {
        "lib.rs": DRAWN,
        "base/mod.rs": "pub mod json;\n",
        "base/json.rs": "",
        "middle.rs": "",
        "top.rs": "use crate::middle::X;\nuse crate::base::json::Y;\n",
    })
    assert check_layers.check(src, set()) == []
    # No cycle here, only a lower layer naming a higher one: it must fail all the same.
    (src / "base/json.rs").write_text("pub fn f() { crate::middle::g(); }\n")
    assert check_layers.cycles(check_layers.graph(src)) == []
    assert check_layers.check(src, set()) == ["base imports middle, a layer above it (layers import downward only)"]


def test_a_unit_the_drawing_does_not_place_fails(tmp_path):
    src = tree(tmp_path, {"lib.rs": DRAWN, "base.rs": "", "middle.rs": "", "top.rs": "", "stray.rs": "use crate::base;\n"})
    assert check_layers.check(src, set()) == ["stray: not in the layers drawn in lib.rs; draw its place"]


def test_a_cycle_between_the_modules_of_one_layer_fails(tmp_path):
    src = tree(tmp_path, {
        "lib.rs": DRAWN,
        "base/mod.rs": "pub mod a; pub mod b;\n",
        "base/a.rs": "use super::b::X;\n",
        "base/b.rs": "",
        "middle.rs": "",
        "top.rs": "",
    })
    assert check_layers.check(src, set()) == []
    (src / "base/b.rs").write_text("use crate::base::a::Y;\n")
    assert check_layers.check(src, set()) == ["import cycle in base/: a b"]


def test_the_real_core_fails_when_a_lower_layer_imports_a_higher_one(tmp_path):
    """A copy of the core with one deliberate upward import (a base parser naming the
    request lifecycle) fails the script the way `make lint` runs it."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ROOT / "crates/core/src", src)
    json = src / "parse/json.rs"
    json.write_text("use crate::lifecycle::RequestFilter;\n" + json.read_text())
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_layers.py"), "--src", str(src)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "parse imports lifecycle, a layer above it" in run.stderr


def test_only_the_host_layers_name_the_host_and_the_worker_no_request_filter(tmp_path):
    drawn = DRAWN.replace("//! top ", "//! lifecycle").replace("//! middle", "//! worker").replace("//! base  ", "//! config")
    src = tree(tmp_path, {
        "lib.rs": drawn,
        "config.rs": "// a Host is mentioned in a comment only\npub struct Policy;\n",
        "worker.rs": "pub fn tick(host: &mut impl Host) {}\n",
        "lifecycle.rs": "pub struct RequestFilter;\nfn f(host: &mut impl Host) {}\n",
    })
    assert check_layers.layers(src) == [["config"], ["worker"], ["lifecycle"]]
    assert check_layers.check(src, set()) == []
    (src / "config.rs").write_text("pub fn read(host: &mut dyn Host) {}\n")
    (src / "worker.rs").write_text("pub fn start() -> RequestFilter { todo!() }\n")
    assert check_layers.check(src, set()) == [
        "config.rs: names the Host, which only effects, lifecycle, worker take",
        "worker.rs: the worker names RequestFilter (a request's life is the lifecycle's)",
    ]
