"""Values are data: whatever string a profile value holds, the rendered documents keep the
structure they have with plain values, and the value reads back exactly (issue 30, part 1).

The profiles are loaded the project's way, then their values are replaced past every type and
rule (`unchecked`), as a value the loader missed would reach the renderer. Each render is
compared with a render of the same profile holding placeholders (`zq<i>qz`) in the same places:
with each placeholder replaced by the value, the documents must be equal, keys, kinds, list
lengths and every string included.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipelines.core.modellock import Lock, cache_key, load_lock, lock_path
from pipelines.core.profiles import Profile, load_profile
from pipelines.stages.render import kubernetes
from pipelines.stages.render.docker import simulator_plans
from pipelines.stages.render.documents import (
    Document,
    RenderError,
    render_template,
    template_env,
    tojson,
)
from pipelines.stages.render.fabric import fabric_jobs
from pipelines.stages.render.kubernetes import STAGE_JOB_ANNOTATION, render_kubernetes

# Hypothesis keeps a cache of each module's constants in its storage folder, ./.hypothesis by
# default: outside the work tree instead (set before its first use, which is in a test).
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "sparkforge-hypothesis")
)
PLACEHOLDER = re.compile(r"zq[0-9]+qz")
PLAN = '{"files": []}\n'  # the ring plan is the pipeline's own JSON, not a profile value
# CI's runs must be the same run: a fixed sequence of examples and no example database
# (which would be written into the work tree).
PROPERTY = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Hostile values, each in every slot at once; the two findings first.
HOSTILE = {
    "issue: quantization adds a secret reference": (
        "exl3\n  refreshPolicy: OnChange\n  sourceSecretRef:\n    name: attacker-secret"
    ),
    "issue: env key adds LD_PRELOAD": (
        "MAX_JOBS\n    - name: LD_PRELOAD\n      value: /cache/evil.so"
    ),
    "a second document": "x\n---\napiVersion: v1\nkind: Secret\nmetadata: {name: s}",
    "document end": "x\n...\n",
    "a flow mapping": "{a: b, c: d}",
    "a flow sequence": "[a, b]",
    "a block sequence entry": "- a",
    "key and value": "key: value",
    "a comment": "a # comment",
    "an anchor": "&anchor x",
    "an alias": "*alias",
    "a python tag": "!!python/object/apply:os.system ['id']",
    "a merge key": "<<: {a: 1}",
    "a literal block": "|\n  text",
    "a folded block": ">\n  text",
    "a directive": "%YAML 1.1",
    "a boolean": "true",
    "yes (YAML 1.1 boolean)": "yes",
    "null": "null",
    "tilde (null)": "~",
    "an integer": "123",
    "an octal": "0o17",
    "a hex": "0x1F",
    "a float": "1e3",
    "dot nan": ".nan",
    "a date": "2026-12-03",
    "empty": "",
    "a space": " ",
    "leading and trailing spaces": "  a  ",
    "a tab": "a\tb",
    "carriage return and line feed": "a\r\nb: c",
    "a double quote": 'a"b',
    "a single quote": "a'b",
    "a backslash escape": "a\\nb",
    "a lone backslash": "\\",
    "jinja expression": "{{ 7 * 7 }}",
    "jinja statement": "{% raw %}x",
    "html": "<script>&amp;</script>",
    "a NUL": "a\x00b",
    "DEL and a C1 control": "a\x7f\x80b",
    "next line (NEL)": "a\x85b: c",
    "line separator": "a\u2028b: c",
    "a byte order mark": "\ufeffa",
    "an astral character": "a\U0001f600b",
    "a long value": "a" * 1000,
}


def unchecked(struct: Any, **changes: Any) -> Any:
    """A copy of a profile struct with some fields changed, past every type and rule."""
    copy = msgspec.structs.replace(struct)
    for name, value in changes.items():
        msgspec.structs.force_setattr(copy, name, value)
    return copy


def fill_tp3(profile: Profile, fill: Callable[[], str]) -> Profile:
    """tp3-ring with every string value the Kubernetes templates write set to fill()."""
    k8s, vllm, fabric, model = profile.kubernetes, profile.vllm, profile.fabric, profile.model
    assert k8s and vllm and fabric
    keys = list(profile.env)
    # Two keys renamed (one reaching the fabric Jobs, which take NCCL_* only), every value set.
    env = {fill(): fill(), "NCCL_" + fill(): fill(), **{k: fill() for k in keys[2:]}}
    return unchecked(
        profile,
        name=fill(),
        runtime=fill(),
        env=env,
        model=unchecked(
            model,
            lock=fill(),
            source_secret=fill(),
            format=fill(),
            quantization=fill(),
            served_name=fill(),
        ),
        kubernetes=unchecked(
            k8s,
            namespace=fill(),
            service_name=fill(),
            storage_class=fill(),
            cache_size=fill(),
            node_cache_path=fill(),
            node_jit_cache_path=fill(),
            shm_size=fill(),
        ),
        resources=unchecked(profile.resources, memory=fill(), cpu=fill()),
        fabric=unchecked(fabric, rdma_resource=fill(), ib_hca=[fill() for _ in fabric.ib_hca]),
        vllm=unchecked(vllm, extra_args=[fill() for _ in vllm.extra_args]),
        members=[
            unchecked(m, node=fill(), claim=fill(), socket_interface=fill(), address=fill())
            for m in profile.members
        ],
    )


@cache
def shipped(name: str) -> Profile:
    """A shipped profile, loaded once."""
    return load_profile(name)


@cache
def shipped_lock() -> Lock:
    """tp3-ring's lock, loaded once."""
    return load_lock(lock_path(shipped("tp3-ring").model.lock))


def render_tp3(fill: Callable[[], str]) -> list[Document]:
    """tp3-ring's documents with ring staging and the fabric check, every value from fill()."""
    loaded, lock = shipped("tp3-ring"), shipped_lock()
    files = [unchecked(lock.files[0], name=fill()), *lock.files[1:]]
    lock = unchecked(lock, source=fill(), files=files)
    profile = fill_tp3(loaded, fill)
    image, stager, patch, probe = fill(), fill(), fill(), fill()
    # The model's cache key (a hash of the source) is the shipped one whatever the source is,
    # so that the paths built from it are the placeholder render's.
    with mock.patch.object(kubernetes, "cache_key", lambda _: cache_key(shipped_lock().source)):
        docs = kubernetes.render_kubernetes(profile, lock, image, patch, (stager, PLAN))
    return [*docs, *fabric_jobs(profile, image, probe)]


def render_local(fill: Callable[[], str]) -> list[Document]:
    """The local profile's launch plans, every string value from fill()."""
    loaded = shipped("local")
    profile = unchecked(
        loaded,
        env={fill(): fill()},
        model=unchecked(loaded.model, served_name=fill()),
        members=[unchecked(m, node=fill(), address=fill()) for m in loaded.members],
    )
    return simulator_plans(profile, fill(), [fill() for _ in profile.members])


def bodies(docs: list[Document]) -> list[dict[str, Any]]:
    """The documents as their files hold them: each file's text must read back as its body."""
    for doc in docs:
        assert yaml.load(doc.text(), Loader=yaml.CSafeLoader) == doc.body, doc.file
    return [doc.body for doc in docs]


def placeholders() -> Callable[[], str]:
    """A fill giving a new placeholder each time: zq0qz, zq1qz, ..."""
    count = iter(range(10**6))
    return lambda: f"zq{next(count)}qz"


def substituted(value: Any, text: str) -> Any:
    """value with every placeholder in its strings and keys replaced by text."""
    if isinstance(value, dict):
        return {substituted(k, text): substituted(v, text) for k, v in value.items()}
    if isinstance(value, list):
        return [substituted(v, text) for v in value]
    if isinstance(value, str):
        return PLACEHOLDER.sub(lambda _: text, value)
    return value


def normal(value: Any) -> Any:
    """value with what may legitimately differ made equal: env lists are sorted by name (a
    value's own order), and the stage Job hash of a later Job (a hash of other values)."""
    if isinstance(value, dict):
        return {
            k: "<sha256>" if k == STAGE_JOB_ANNOTATION else normal_entry(k, v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [normal(v) for v in value]
    return value


def normal_entry(key: Any, value: Any) -> Any:
    """One mapping entry's value, normalised; an env list sorted by its names."""
    value = normal(value)
    if key == "env" and isinstance(value, list):
        return sorted(value, key=lambda e: repr(e.get("name")))
    return value


def shape(value: Any, path: str = "") -> set[str]:
    """The document's structure: every key path with its node's kind, and list lengths (the
    keys of env and limits mappings, which are values, as <key>)."""
    if isinstance(value, dict):
        found = {f"{path}:map"}
        valued = path.endswith(("/env", "/limits"))
        for k, v in value.items():
            found |= shape(v, f"{path}/{'<key>' if valued else k}")
        return found
    if isinstance(value, list):
        found = {f"{path}:list[{len(value)}]"}
        for i, v in enumerate(value):
            found |= shape(v, f"{path}/{i}")
        return found
    return {f"{path}:{type(value).__name__}"}


def env_names(docs: list[dict[str, Any]]) -> set[str]:
    """Every env name the documents set besides the profile's placeholders."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("env"), list):
                found.update(e["name"] for e in value["env"])
            if isinstance(value.get("env"), dict):
                found.update(value["env"])
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(docs)
    return {name for name in found if not PLACEHOLDER.search(name)}


Renderer = Callable[[Callable[[], str]], list[Document]]


@cache
def placed(render: Renderer) -> list[dict[str, Any]]:
    """A renderer's documents with placeholders, rendered once."""
    return bodies(render(placeholders()))


def overrides_a_set_name(render: Renderer, text: str) -> bool:
    """Whether text as an env key is a name the renderer sets itself, overriding it by design."""
    return bool({text, "NCCL_" + text} & env_names(placed(render)))


def assert_value_is_data(render: Renderer, text: str, written: bool = True) -> None:
    """The render with text in every slot equals the placeholder render with text put in; when
    written, so do the files' texts (the property tests skip that: PyYAML's emitter is slow)."""
    expected = normal(substituted(placed(render), text))
    docs = render(lambda: text)
    got = normal(bodies(docs) if written else [doc.body for doc in docs])
    if got != expected:  # the structure first, for the clearer message
        assert [shape(d) for d in got] == [shape(d) for d in expected]
    assert got == expected


@pytest.mark.parametrize("render", [render_tp3, render_local], ids=["tp3-ring", "local"])
def test_placeholders_render_the_shipped_profiles_structure(render):
    name = "tp3-ring" if render is render_tp3 else "local"
    assert [shape(d) for d in placed(render)] == [shape(d) for d in SHIPPED[name]()]


def shipped_tp3() -> list[dict[str, Any]]:
    """tp3-ring as it ships, rendered like render_tp3 (its second env key NCCL_ too, as there)."""
    profile = shipped("tp3-ring")
    keys = list(profile.env)
    env = {("NCCL_" + k if k == keys[1] else k): v for k, v in profile.env.items()}
    profile = unchecked(profile, env=env)
    lock = shipped_lock()
    image = "registry.example/x@sha256:" + "c" * 64
    docs = render_kubernetes(profile, lock, image, "patch", (image, PLAN))
    return bodies([*docs, *fabric_jobs(profile, image, "probe")])


def shipped_local() -> list[dict[str, Any]]:
    """The local profile as it ships, rendered like render_local."""
    profile = shipped("local")
    return bodies(simulator_plans(profile, "local-sim@sha256:" + "c" * 64, ["/models/x"]))


SHIPPED = {"tp3-ring": shipped_tp3, "local": shipped_local}


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
@pytest.mark.parametrize("render", [render_tp3, render_local], ids=["tp3-ring", "local"])
def test_a_hostile_value_in_every_field_changes_no_documents_structure(render, text):
    assert not overrides_a_set_name(render, text)
    assert_value_is_data(render, text)


@PROPERTY
@given(text=st.text(max_size=40))
def test_any_string_in_every_tp3_field_changes_no_documents_structure(text):
    assume(not overrides_a_set_name(render_tp3, text))
    assert_value_is_data(render_tp3, text, written=False)


@PROPERTY
@given(text=st.text(max_size=40))
def test_any_string_in_every_local_field_changes_no_launch_plans_structure(text):
    assume(not overrides_a_set_name(render_local, text))
    assert_value_is_data(render_local, text)


@PROPERTY
@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=12,
    )
)
def test_tojson_writes_a_yaml_node_that_reads_back_as_the_value(value):
    assert yaml.safe_load(f"key: {tojson(value)}\nnext: 1\n") == {"key": value, "next": 1}


def scratch_template(folder: Path, text: str) -> list[dict[str, Any]]:
    """Render one template text from a scratch folder, with x = 'a: b'."""
    (folder / "t.yaml.j2").write_text(text)
    return render_template(template_env(folder), "t.yaml.j2", {"x": "a: b", "n": 3})


@pytest.mark.parametrize(
    "text",
    ["key: {{ x }}\n", "key: {{ n }}\n", "key: {{ x | e }}\n", "key: {{ x | safe }}\n"],
    ids=["a string", "an integer", "html escaped", "marked safe"],
)
def test_a_value_written_as_raw_text_is_refused_in_one_line(tmp_path, text):
    with pytest.raises(RenderError) as err:
        scratch_template(tmp_path, text)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("/") and "t.yaml.j2: " in message
    assert "is written as raw text; expected it through `| tojson`" in message


def test_a_value_through_tojson_is_data(tmp_path):
    assert scratch_template(tmp_path, "key: {{ x | tojson }}\nn: {{ n | tojson }}\n") == [
        {"key": "a: b", "n": 3}
    ]


@pytest.mark.parametrize("value", [math.nan, math.inf, object()], ids=["nan", "inf", "object"])
def test_a_value_json_cannot_spell_is_refused_in_one_line(tmp_path, value):
    (tmp_path / "t.yaml.j2").write_text("key: {{ v | tojson }}\n")
    with pytest.raises(RenderError) as err:
        render_template(template_env(tmp_path), "t.yaml.j2", {"v": value})
    assert "\n" not in str(err.value) and "t.yaml.j2: " in str(err.value)


def test_a_missing_value_is_named_through_tojson_too(tmp_path):
    (tmp_path / "t.yaml.j2").write_text("key: {{ missing | tojson }}\n")
    with pytest.raises(RenderError) as err:
        render_template(template_env(tmp_path), "t.yaml.j2", {})
    assert str(err.value).endswith("t.yaml.j2: 'missing' is undefined")


def test_a_mapping_key_past_yamls_1024_characters_is_refused_in_one_line():
    # rdma_resource is the key of the fabric Job's limits; the loader caps it at 253.
    with pytest.raises(RenderError) as err:
        render_tp3(lambda: "a" * 1100)
    message = str(err.value)
    assert "\n" not in message
    assert re.search(
        r"/manifests/fabric/job\.yaml\.j2: renders as no YAML: while parsing a flow mapping: did"
        r" not find expected ',' or '}' \(line [0-9]+, column [0-9]+\)$",
        message,
    ), message
