"""Profiles load once, at the edge, and a wrong field is one line naming file and field."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from support.doit import run_doit

from pipelines.core.profiles import PROFILES_DIR, ProfileError, available_profiles, load_profile

REPO = Path(__file__).resolve().parent.parent


def copy_profile(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of a shipped profile with one piece of text replaced."""
    text = (PROFILES_DIR / f"{name}.yaml").read_text()
    assert old in text
    (tmp_path / f"{name}.yaml").write_text(text.replace(old, new, 1))
    return tmp_path


@pytest.mark.parametrize("name", ["local", "tp3-ring", "tp4-ring"])
def test_each_shipped_profile_loads(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.parallel.tensor * profile.parallel.pipeline == len(profile.members)


def test_profiles_agree_with_the_domain_facts():
    tp3, tp4 = load_profile("tp3-ring"), load_profile("tp4-ring")
    assert tp3.model.source == "s3://models/bot-lab-21/DeepSeek-V4.1-Flash-EXL3-3.5bpw-Pollard"
    assert (tp3.parallel.tensor, tp3.vllm.gpu_memory_utilization) == (3, 0.78)
    assert tp3.model.config_patch == "tp3-heads" and tp4.model.config_patch == "none"
    assert tp3.fabric.ib_hca == ["rocep1s0f0", "rocep1s0f1", "roceP2p1s0f0", "roceP2p1s0f1"]
    assert (tp3.fabric.rdma_resource, tp3.fabric.ib_gid_index) == ("rdma/rdma_shared_device_a", 3)
    assert tp3.env["TORCH_CUDA_ARCH_LIST"] == "12.1a"
    assert (tp4.sglang.context_length, tp4.sglang.max_total_tokens) == (1_048_576, 8_000_000)
    assert (tp4.sglang.max_running_requests, tp4.sglang.mem_fraction_static) == (8, 0.80)
    assert tp4.fabric.patched_nccl and not tp3.fabric.patched_nccl
    # Both gate on figures measured with DSpark k=5: they run what was measured.
    assert tp3.vllm.speculative.num_speculative_tokens == 5
    assert tp4.sglang.speculative.num_speculative_tokens == 5
    assert set(available_profiles()) >= {"local", "tp3-ring", "tp4-ring"}


FACTS = PROFILES_DIR / "FACTS.md"


def test_the_facts_the_code_cites_are_on_the_projects_own_page():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    texts = {name: (REPO / name).read_text(errors="replace") for name in tracked}
    # Nothing cites a page outside the project; the facts page is cited where facts are used.
    outside = "domain" + ".md"  # spelled apart, or this file would cite it
    assert [name for name, text in texts.items() if outside in text] == []
    citing = {name for name, text in texts.items() if "FACTS.md" in text} - {
        "tests/test_profiles.py"
    }
    assert len(citing) >= 10, sorted(citing)
    headings = [line[3:] for line in FACTS.read_text().splitlines() if line.startswith("## ")]
    sections = 0
    for name in citing:
        # A section named as `FACTS.md, "Heading"` or `FACTS.md beside this file ("Heading")`.
        for quoted in re.findall(r'FACTS\.md(?:, | [^"\n(]{0,30}\()"([^"]+)"', texts[name]):
            assert any(h.startswith(quoted) for h in headings), (name, quoted)
            sections += 1
    assert sections >= 5
    # The figures the code and profiles gate on are the page's.
    from pipelines.core.settings import DEPLOY_TIMEOUT_S
    from pipelines.stages.fabric.expect import TP3_MEASURED_BUSBW

    page = FACTS.read_text()
    assert f"**{TP3_MEASURED_BUSBW} GB/s**" in page
    assert f"{DEPLOY_TIMEOUT_S:.0f} s, twice the {DEPLOY_TIMEOUT_S / 120:.0f} minutes" in page
    assert "2 to 8 minutes" in page and "0.78 is the floor" in page


def test_misspelled_field_is_one_line_naming_file_field_and_expected(tmp_path):
    folder = copy_profile(tmp_path, "tp3-ring", "  rdma_resource:", "  rdma_resorce:")
    with pytest.raises(ProfileError) as err:
        load_profile("tp3-ring", folder)
    message = str(err.value)
    assert "\n" not in message
    assert str(folder / "tp3-ring.yaml") in message
    assert "'fabric.rdma_resorce'" in message
    assert "did you mean 'rdma_resource'" in message


def test_a_wrong_value_in_a_mapping_names_its_key(tmp_path):
    folder = copy_profile(tmp_path, "tp3-ring", 'MAX_JOBS: "1"', "MAX_JOBS: 1")
    with pytest.raises(ProfileError, match=r"field 'env.MAX_JOBS': expected `str`, got `int`$"):
        load_profile("tp3-ring", folder)


def test_a_field_given_twice_is_refused_naming_its_line(tmp_path):
    folder = copy_profile(tmp_path, "tp3-ring", "  mtu: 9000\n", "  mtu: 9000\n  mtu: 1500\n")
    with pytest.raises(ProfileError, match=r"line \d+: not valid YAML: key 'mtu' given twice$"):
        load_profile("tp3-ring", folder)


def test_a_profile_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "tp3-ring.yaml"
    path.write_bytes((PROFILES_DIR / "tp3-ring.yaml").read_bytes() + b"# \xff\n")
    folder = tmp_path
    with pytest.raises(ProfileError, match=r"tp3-ring.yaml: not UTF-8 text: byte \d+ is 0xff$"):
        load_profile("tp3-ring", folder)


def test_out_of_range_value_names_the_field(tmp_path):
    folder = copy_profile(
        tmp_path, "tp3-ring", "gpu_memory_utilization: 0.78", "gpu_memory_utilization: 1.5"
    )
    with pytest.raises(
        ProfileError, match=r"field 'vllm.gpu_memory_utilization': expected `float` <= 0.99"
    ):
        load_profile("tp3-ring", folder)


def test_parallelism_that_does_not_cover_the_ring_is_refused(tmp_path):
    folder = copy_profile(tmp_path, "tp3-ring", "parallel: {tensor: 3", "parallel: {tensor: 4")
    with pytest.raises(
        ProfileError, match=r"field 'parallel': tensor x pipeline = 4, expected .* = 3"
    ):
        load_profile("tp3-ring", folder)


def test_member_in_a_list_with_a_typo_is_named_by_index(tmp_path):
    folder = copy_profile(tmp_path, "tp4-ring", "{node: spark-2,", "{nod: spark-2,")
    with pytest.raises(
        ProfileError, match=r"unknown field 'members.1.nod' \(did you mean 'node'\?\)"
    ):
        load_profile("tp4-ring", folder)


def test_doit_with_a_bad_profile_exits_nonzero_with_one_line():
    result = run_doit("list", "profile=no-such-ring")
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0
    assert "profile 'no-such-ring'" in result.stderr and "tp3-ring" in result.stderr


@pytest.mark.parametrize(
    "name",
    [
        "{tmp}/evil",
        "../../../../{tmp}/evil",
        "evil/../tp3-ring",
        "a" * 300,
        "Local",
        "tp3-ring.yaml",
    ],
)
def test_a_profile_name_is_a_name_never_a_path(tmp_path, name):
    # A valid profile where a path would find it: only the name check keeps it from loading.
    (tmp_path / "evil.yaml").write_text(
        (PROFILES_DIR / "local.yaml").read_text().replace("name: local", "name: evil")
    )
    name = name.format(tmp=tmp_path)
    with pytest.raises(ProfileError) as refused:
        load_profile(name)
    said = str(refused.value)
    assert said.endswith("expected a profile name (lowercase letters, digits and '-', at most 63),"
                         " not a path")  # fmt: skip
    assert len(said) < 200  # a long value is shortened, never echoed whole


def test_a_path_as_profile_is_one_line_and_exit_2(tmp_path):
    result = run_doit("list", f"profile={tmp_path}/evil")
    assert result.returncode == 2
    assert result.stderr == (
        f"error: profile='{tmp_path}/evil': expected a profile name (lowercase letters, digits"
        " and '-', at most 63), not a path\n"
    )


def doit_without_a_stack(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """doit in the checkout with the local stack's folder empty: nothing runs, nothing recorded."""
    env = {**os.environ, "SPARKFORGE_STACK_DIR": str(tmp_path / "no-stack")}
    env["SPARKFORGE_STORE"] = str(tmp_path / "store")
    return run_doit(*args, env=env)


# What `doit list` shows for every profile: one task per stage at least, whatever is running.
STAGE_TASKS = {"profile", "fetch_weights", "stage_weights", "image", "render", "deploy", "bench"}


@pytest.mark.parametrize("name", available_profiles())
def test_doit_list_and_help_need_nothing_running(tmp_path, name):
    listed = doit_without_a_stack(tmp_path, "list", f"profile={name}")
    assert listed.returncode == 0, listed.stderr
    tasks = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    assert tasks >= STAGE_TASKS, sorted(STAGE_TASKS - tasks)
    # A stage with nothing to do for the profile yields no task, not an empty group named for
    # its dodo.py variable (what doit makes of an empty generator).
    assert all(task.islower() for task in tasks), sorted(tasks)
    profile = load_profile(name)
    wanted = (len(profile.members) > 1, profile.fabric is not None)
    assert ("stager_image" in tasks, "fabric" in tasks) == wanted
    helped = doit_without_a_stack(tmp_path, "help", "deploy", f"profile={name}")
    assert helped.returncode == 0, helped.stderr
    assert "deploy the built profile" in helped.stdout


def test_a_task_that_needs_the_stack_names_what_to_start_when_it_is_down(tmp_path):
    result = doit_without_a_stack(tmp_path, "image", "profile=local")
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    said = [line for line in (result.stdout + result.stderr).splitlines() if "endpoints" in line]
    assert said == [
        f"{tmp_path / 'no-stack' / 'endpoints.json'}: missing; run `scripts/stack up` first"
    ]


def test_tp3_padding_on_a_tensor_size_it_does_not_fit_is_refused(tmp_path):
    folder = copy_profile(tmp_path, "tp4-ring", "config_patch: none", "config_patch: tp3-heads")
    with pytest.raises(ProfileError, match=r"field 'model.config_patch': .* tensor 4 does not"):
        load_profile("tp4-ring", folder)


# Profile edits the loader itself refuses: (edit, the field and rule its one line must name).
REFUSED_AT_LOAD = {
    "four members at TP3": (
        (
            "- {node: spark-3,",
            "- {node: spark-4, address: 192.168.100.14,"
            " socket_interface: enP7s7, claim: c4}\n  - {node: spark-3,",
        ),
        "field 'parallel': tensor x pipeline = 3, expected members x resources.gpu = 4",
    ),
    "a member without an address": (
        ("{node: spark-2, address: 192.168.100.12,", "{node: spark-2,"),
        "field 'members.1.address': required",
    ),
    "no TP3 patch": (
        ("config_patch: tp3-heads", "config_patch: none"),
        "field 'model.config_patch': tensor 3 does not divide 64 heads",
    ),
    "a member without a claim": (
        (", claim: dsv41-cache-spark-3}", "}"),
        "field 'members.2.claim': required by deploy 'kubernetes'",
    ),
    "pipeline parallel 2": (
        ("parallel: {tensor: 3, pipeline: 1}", "parallel: {tensor: 3, pipeline: 2}"),
        "field 'parallel': tensor x pipeline = 6",
    ),
    "memory in GB": (("memory: 110Gi", "memory: 110GB"), "field 'resources.memory'"),
    "rendezvous port out of range": (
        ("rendezvous_port: 29500", "rendezvous_port: 70000"),
        "field 'fabric.rendezvous_port'",
    ),
    "rendezvous port below the operator's 1024": (
        ("rendezvous_port: 29500", "rendezvous_port: 1023"),
        "field 'fabric.rendezvous_port': expected `int` >= 1024",
    ),
    "a --quantization argument": (
        ("- --enable-auto-tool-choice", "- --quantization=exl3"),
        "field 'vllm.extra_args': --quantization must not be used",
    ),
    "no hygiene section": (("hygiene: {", "unused: {"), "unknown field 'unused'"),
    "--hf-overrides in vLLM's underscore spelling": (
        ("- --enable-auto-tool-choice", "- --hf_overrides={}"),
        "field 'vllm.extra_args': --hf_overrides must not be used",
    ),
    "--quantization as -q": (
        ("- --enable-auto-tool-choice", "- -q=exl3"),
        "field 'vllm.extra_args': -q must not be used",
    ),
    "two members claiming one cache": (
        ("claim: dsv41-cache-spark-2}", "claim: dsv41-cache-spark-1}"),
        "field 'members.1.claim': 'dsv41-cache-spark-1' is members.0's too",
    ),
    "two members on one node": (
        ("{node: spark-2,", "{node: spark-1,"),
        "field 'members.1.node': 'spark-1' is members.0's too",
    ),
}


def test_a_four_node_ring_asking_for_the_patched_nccl_must_mount_it(tmp_path):
    text = (PROFILES_DIR / "tp4-ring.yaml").read_text()
    overlay = text.index("  nccl_overlay:")
    end = text.index("\n", text.index("container_path:", overlay))
    (tmp_path / "tp4-ring.yaml").write_text(text[:overlay] + text[end + 1 :])
    with pytest.raises(ProfileError) as err:
        load_profile("tp4-ring", tmp_path)
    assert "field 'sglang.nccl_overlay': required by fabric.patched_nccl" in str(err.value)


@pytest.mark.parametrize("case", sorted(REFUSED_AT_LOAD))
def test_a_broken_ring_profile_is_refused_at_load_naming_its_field(case, tmp_path):
    (old, new), expected = REFUSED_AT_LOAD[case]
    folder = copy_profile(tmp_path, "tp3-ring", old, new)
    with pytest.raises(ProfileError) as err:
        load_profile("tp3-ring", folder)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(str(folder / "tp3-ring.yaml"))
    assert expected in message, message


# Values that documents carry as they are: a newline in one would add keys, env entries or a
# secret reference to what is rendered (issue 30's two findings first), so each is refused when
# the profile loads, naming its field.
@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        (
            "  quantization: exl3",
            '  quantization: "exl3\\n  refreshPolicy: OnChange\\n  sourceSecretRef:\\n'
            '    name: attacker-secret"',
            "model.quantization",
        ),
        ('  MAX_JOBS: "1"', '  "MAX_JOBS\\nLD_PRELOAD": /cache/evil.so', "env"),
        ('  MAX_JOBS: "1"', '  "1BAD": "x"', "env"),
        (
            "  served_name: DeepSeek-V4.1-Flash-EXL3",
            '  served_name: "a\\nb: c"',
            "model.served_name",
        ),
        (
            "socket_interface: enP7s7, claim: dsv41-cache-spark-1",
            'socket_interface: "enP7s7\\nx: y", claim: dsv41-cache-spark-1',
            "members.0.socket_interface",
        ),
        (
            "  node_cache_path: /var/lib/llmkube/models",
            '  node_cache_path: "/var/lib/llmkube/models\\n    type: Socket"',
            "kubernetes.node_cache_path",
        ),
        (
            "  node_jit_cache_path: /var/lib/sparkforge/jit-cache",
            "  node_jit_cache_path: var/lib/sparkforge/jit-cache",
            "kubernetes.node_jit_cache_path",
        ),
        (
            "  rdma_resource: rdma/rdma_shared_device_a",
            '  rdma_resource: "rdma/a: \\"1\\", nvidia.com/gpu"',
            "fabric.rdma_resource",
        ),
        ("roceP2p1s0f1]", '"roceP2p1s0f1,mlx5_9"]', "fabric.ib_hca"),
    ],
    ids=[
        "quantization",
        "env key with a newline",
        "env key of a digit",
        "served name",
        "netdev",
        "cache path with a newline",
        "relative jit cache path",
        "rdma resource adding a limit",
        "ib device adding a device",
    ],
)
def test_a_value_that_could_change_a_documents_structure_is_refused_at_load(
    tmp_path, old, new, field
):
    folder = copy_profile(tmp_path, "tp3-ring", old, new)
    with pytest.raises(ProfileError) as err:
        load_profile("tp3-ring", folder)
    message = str(err.value)
    assert "\n" not in message and f"field '{field}" in message
    if field == "env":  # the key named, as a repr: its newline shows as \n
        assert re.search(r"field 'env': key '[^']*'", message)
