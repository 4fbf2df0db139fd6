"""The Docker-hosts renderer (tp4-ring): one launch plan per node, what the deploy step runs."""

from __future__ import annotations

from typing import Any

from pipelines.core.modellock import cache_key
from pipelines.core.profiles import Profile, option_name, required
from pipelines.stages.render.documents import Document, RenderError, RenderInputs
from pipelines.stages.render.validate import check_ring_rules, check_secrets

SGLANG_PORT = 8080


def sglang_env(profile: Profile, rank: int) -> dict[str, str]:
    """The NCCL environment of one SGLang rank, from the topology and its management NIC.

    A two-node pair needs none of the ring-only settings; rings of three or more route by
    subnet, and the patched (sparkring) NCCL runs ring-only, skipping Tree/PAT setup.
    """
    fabric = required(profile.fabric, "fabric", profile)
    env = {
        "NCCL_NET": "IB",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_GID_INDEX": str(fabric.ib_gid_index),
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_IB_HCA": ",".join(fabric.ib_hca),
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_SOCKET_IFNAME": profile.members[rank].socket_interface,
    }
    if len(profile.members) >= 3:
        env |= {
            "NCCL_IB_MERGE_NICS": "0",
            "NCCL_IB_SUBNET_AWARE_ROUTING": "1",
            "NCCL_IB_SUBNET_PREFIX_LEN": "24",
            "NCCL_CROSS_NIC": "1",
            "NCCL_ALGO": "Ring",
            "NCCL_MIN_NCHANNELS": "4",
        }
    if fabric.patched_nccl:
        env["NCCL_SWITCHLESS_RING_ONLY"] = "1"
    return {**env, **profile.env}


def sglang_command(profile: Profile, rank: int) -> list[str]:
    """The SGLang server command of one rank."""
    s = required(profile.sglang, "sglang", profile)
    fabric = required(profile.fabric, "fabric", profile)
    command = [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models",
        "--served-model-name",
        profile.model.served_name,
        "--tp",
        str(profile.parallel.tensor),
        "--nnodes",
        str(len(profile.members)),
        "--node-rank",
        str(rank),
        "--dist-init-addr",
        f"{profile.members[0].address}:{fabric.rendezvous_port}",
        "--context-length",
        str(s.context_length),
        "--max-running-requests",
        str(s.max_running_requests),
        "--max-total-tokens",
        str(s.max_total_tokens),
        "--mem-fraction-static",
        f"{s.mem_fraction_static:.2f}",
        "--chunked-prefill-size",
        str(s.chunked_prefill_size),
        "--host",
        "0.0.0.0",
        "--port",
        str(SGLANG_PORT),
    ]
    if s.speculative:
        command += [
            "--speculative-algorithm",
            s.speculative.method.upper(),
            "--speculative-num-steps",
            str(s.speculative.num_speculative_tokens),
        ]
    # /metrics exists only with it, and the bench reads load and latency there.
    command.append("--enable-metrics")
    rendered = {a for a in command if a.startswith("--")}
    for arg in s.extra_args:
        # SGLang's parser, like vLLM's, reads '_' in a long option as '-'.
        if option_name(arg) in rendered:
            raise RenderError(
                f"profile {profile.name}: field 'sglang.extra_args': {arg.split('=')[0]} is set"
                " by the renderer from the profile; expected an option it does not set"
            )
    return command + list(s.extra_args)


def launch_plans(profile: Profile, image: str, folders: list[str]) -> list[Document]:
    """One launch plan per node: image by digest, env, mounts (NCCL overlay, its staged model
    folder), command."""
    overlay = required(profile.sglang, "sglang", profile).nccl_overlay
    plans = []
    for rank, member in enumerate(profile.members):
        mounts: list[dict[str, Any]] = [
            {"source": folders[rank], "target": "/models", "read_only": True},
        ]
        if overlay:
            # Bind-mounted over the image's own pip NCCL: one NCCL runtime, never two on a path.
            mounts.append(
                {"source": overlay.host_path, "target": overlay.container_path, "read_only": True}
            )
        plan = {
            "node": member.node,
            "rank": rank,
            "address": str(member.address),
            "port": SGLANG_PORT,
            "image": image,
            "network_mode": "host",
            "ipc_mode": "host",
            "devices": ["/dev/infiniband"],
            "gpus": "all",
            "env": dict(sorted(sglang_env(profile, rank).items())),
            "mounts": mounts,
            "command": sglang_command(profile, rank),
        }
        plans.append(Document(f"launch-{rank}-{member.node}.yaml", plan))
    return plans


def staged_folders(profile: Profile, model: RenderInputs) -> list[str]:
    """Each member's staged model folder: under its own weights root, else the profile's."""
    key = cache_key(model.lock.source)
    return [f"{m.weights_root or model.weights_root}/models/{key}" for m in profile.members]


def simulator_plans(profile: Profile, image: str, folders: list[str]) -> list[Document]:
    """One launch plan per member of the simulated runtime: the image's own command, SIM_* env.

    Member r listens on its own address (as a ring member's server is reached at its management
    address), port + r: the local stack's engines share this machine's network. The members
    serve each on its own, no group among them, so a deploy restarts only a changed one.
    """
    sim = required(profile.simulator, "simulator", profile)
    env = {
        "SIM_MODEL_DIR": "/models",
        "SIM_SERVED_MODEL_NAME": profile.model.served_name,
        "SIM_MAX_MODEL_LEN": str(sim.max_model_len),
        "SIM_MAX_RUNNING": str(sim.max_running_requests),
        "SIM_TTFT_S": str(sim.ttft_s),
        "SIM_PREFILL_TOK_S": str(sim.prefill_tok_s),
        "SIM_DECODE_TOK_S": str(sim.decode_tok_s),
        "SIM_DECODE_FALLOFF": str(sim.decode_falloff),
        "SIM_DECODE_JITTER": str(sim.decode_jitter),
        "SIM_TOKENS_PER_CHUNK": str(sim.tokens_per_chunk),
        "SIM_EMPTY_CHUNKS": "1" if sim.empty_chunks else "0",
    }
    return [
        Document(
            f"launch-{rank}-{member.node}.yaml",
            {
                "node": member.node,
                "rank": rank,
                "address": str(member.address),
                "port": sim.port + rank,
                "image": image,
                "network_mode": "host",
                "restarts": "alone",
                "env": dict(
                    sorted(
                        {
                            **env,
                            "SIM_HOST": str(member.address),
                            "SIM_PORT": str(sim.port + rank),
                            **profile.env,
                        }.items()
                    )
                ),
                "mounts": [{"source": folders[rank], "target": "/models", "read_only": True}],
            },
        )
        for rank, member in enumerate(profile.members)
    ]


def checked(docs: list[Document], secrets: list[str]) -> list[Document]:
    """Launch plans that pass the ring's rules (images pinned) and hold no secret."""
    violations = check_ring_rules(docs) + check_secrets(docs, secrets)
    if violations:
        raise RenderError("\n".join(violations))
    return docs


def render_simulated(profile: Profile, model: RenderInputs, secrets: list[str]) -> list[Document]:
    """The simulated runtime's launch plans, checked like a ring's."""
    folders = staged_folders(profile, model)
    return checked(simulator_plans(profile, model.image, folders), secrets)


def render(profile: Profile, model: RenderInputs, secrets: list[str]) -> list[Document]:
    """The SGLang launch plans of a profile, checked."""
    return checked(launch_plans(profile, model.image, staged_folders(profile, model)), secrets)
