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


ROUTES = {
    "lib.rs": "pub mod lifecycle;\n",
    # The dispatcher calls every route, and takes their outcomes.
    "lifecycle/mod.rs": (
        "mod answer; mod direct; mod lease;\n"
        "use lease::FromLease;\n"
        "pub struct RequestFilter;\n"
        "impl RequestFilter {\n"
        "    fn dispatch(&mut self) { match self.admit_from_lease() { FromLease::Ask => self.send_charge() } }\n"
        "}\n"
    ),
    "lifecycle/lease.rs": (
        "use super::RequestFilter;\n"
        "pub(super) enum FromLease { Ask }\n"
        "impl RequestFilter {\n"
        "    pub(super) fn admit_from_lease(&mut self) -> FromLease { self.count_admission(); FromLease::Ask }\n"
        "}\n"
        "fn put_back(n: u32) -> u32 { n }\n"
        "struct Knowledge;\n"
        "impl Learned for Knowledge {\n"
        "    fn count(&mut self) -> u64 { 0 }\n"
        "}\n"
    ),
    "lifecycle/direct.rs": (
        "use super::RequestFilter;\n"
        "impl RequestFilter {\n"
        "    // put_back(1) is only mentioned here\n"
        "    pub(super) fn send_charge(&mut self) { self.count_admission(); [1].iter().count(); }\n"
        "}\n"
    ),
    # Shared by every route: they may call it.
    "lifecycle/answer.rs": (
        "use super::RequestFilter;\n"
        "impl RequestFilter {\n"
        "    pub(super) fn count_admission(&self) {}\n"
        "}\n"
    ),
    "lifecycle/direct_tests.rs": "fn t(f: &mut RequestFilter) { f.admit_from_lease(); }\n",
}


def test_an_admission_route_calling_another_fails(tmp_path):
    """Routes return their outcome to the dispatcher in lifecycle/mod.rs: one calling a
    method or function another route defines, or naming its module, fails; the shared
    modules (`answer`) may be called by all and call no route. A trait's method of the same
    name as a call (`count`), comments and test files are not calls."""
    src = tree(tmp_path, ROUTES)
    assert check_layers.route_calls(src) == []
    assert check_layers.check(src, set()) == []
    direct = src / "lifecycle/direct.rs"
    clean = direct.read_text()
    direct.write_text(clean.replace("self.count_admission();", "self.count_admission(); self.admit_from_lease();"))
    route_call = (
        "lifecycle/direct: calls admit_from_lease, of the lease route (a route returns its outcome to the"
        " dispatcher in lifecycle/mod.rs, never calls another)"
    )
    assert check_layers.check(src, set()) == [route_call]
    direct.write_text(clean.replace("[1].iter().count();", "let n = put_back(1);"))
    assert check_layers.route_calls(src) == [route_call.replace("admit_from_lease", "put_back")]
    direct.write_text("use super::lease::FromLease;\n" + clean)
    assert check_layers.route_calls(src) == ["lifecycle/direct: names the lease route's module"]
    direct.write_text(clean)
    (src / "lifecycle/answer.rs").write_text(ROUTES["lifecycle/answer.rs"].replace("{}", "{ self.send_charge() }"))
    assert check_layers.route_calls(src) == [
        "lifecycle/answer: calls send_charge, of the direct route (a route returns its outcome to the"
        " dispatcher in lifecycle/mod.rs, never calls another)"
    ]


def test_the_real_lifecycle_is_split_by_route_and_fails_on_a_route_calling_another(tmp_path):
    """The rule is not vacuous over the core: it finds its routes, and a copy of the core
    whose degraded mode puts the lease's hold back itself fails the script."""
    import shutil

    routes = check_layers.route_modules(ROOT / "crates/core/src")
    assert {"identify", "provider", "overflow", "lease", "direct", "queue", "degraded", "store"} <= set(routes)
    assert "put_back_hold" in routes["lease"][1]
    src = tmp_path / "src"
    shutil.copytree(ROOT / "crates/core/src", src)
    degraded = src / "lifecycle/degraded.rs"
    text = degraded.read_text()
    anchor = "        host.add_metric(Metric::DegradedDecisions, 1);\n"
    assert anchor in text
    degraded.write_text(text.replace(anchor, anchor + "        self.put_back_hold(host, config);\n"))
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_layers.py"), "--src", str(src)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "lifecycle/degraded: calls put_back_hold, of the lease route" in run.stderr
