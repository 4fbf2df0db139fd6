"""The stack's Docker engines (private dockerds) and the sshd that reaches the second one."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from devstack.processes import Command, kill_leftovers, unmount_below
from devstack.settings import HOST, STACK_DIR_ENV, Settings, StackError

# sun_path is 108 bytes including the terminating NUL.
UNIX_SOCKET_PATH_MAX = 107


def system_binary(name: str, debian_package: str) -> str:
    """A Debian-packaged binary, looked up on PATH and in the sbin folders."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])
    found = shutil.which(name, path=path)
    if not found:
        raise StackError(f"{name}: not installed; run scripts/install (Debian {debian_package})")
    return found


def clean_env(drop_prefixes: tuple[str, ...]) -> dict[str, str]:
    """This process's environment without variables that would reconfigure a service."""
    return {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}


def engine_answers(docker_host: str) -> bool:
    """Whether a Docker Engine answers /_ping at docker_host."""
    import docker
    import requests

    try:
        # A fixed old API version skips the version round trip the client would make first.
        with docker.APIClient(base_url=docker_host, version="1.24", timeout=2) as client:
            return bool(client.ping())
    except (docker.errors.DockerException, requests.RequestException, OSError):
        return False


# --- dockerd ------------------------------------------------------------------------------


def dockerd_marker(name: str) -> Callable[[Path], str]:
    """The data root argument of the stack's engine `name`."""
    return lambda directory: f"--data-root={directory / name / 'root'}"


def dockerd_command(name: str, address: str) -> Callable[[Settings, Mapping[str, str]], Command]:
    """The command of a private dockerd in folder `name`: no bridge or iptables."""

    def command(cfg: Settings, credentials: Mapping[str, str]) -> Command:
        folder = cfg.directory / name
        folder.mkdir(exist_ok=True)
        longest = folder / "exec" / "containerd" / "containerd.sock.ttrpc"
        if len(str(longest)) > UNIX_SOCKET_PATH_MAX:
            raise StackError(
                f"{name}: stack folder {cfg.directory} is too long for dockerd's unix sockets"
                f" ({len(str(longest))} > {UNIX_SOCKET_PATH_MAX} chars); set {STACK_DIR_ENV}"
                " shorter"
            )
        # An empty daemon config: /etc/docker/daemon.json may set hosts or storage that clash.
        (folder / "daemon.json").write_text("{}\n")
        # No --storage-driver: dockerd takes overlay2 where the kernel and the folder's
        # filesystem allow it (a container starts without copying its image), else vfs.
        argv = [
            system_binary("dockerd", "docker.io"),
            f"--config-file={folder / 'daemon.json'}",
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            dockerd_marker(name)(cfg.directory),
            f"--exec-root={folder / 'exec'}",
            f"--host={getattr(cfg, address)}",
            f"--pidfile={folder / 'dockerd.pid'}",
        ]
        return Command(argv, clean_env(("DOCKER_",)), ())

    return command


def dockerd_cleanup(name: str) -> Callable[[Path], None]:
    """End what a killed dockerd left (containerd, shims, mounts) below its folder."""

    def cleanup(directory: Path) -> None:
        kill_leftovers(directory / name / "exec")
        unmount_below(directory / name)

    return cleanup


# --- sshd: OpenSSH on 127.0.0.1, keys made by the stack -----------------------------------


def ssh_files(directory: Path) -> dict[str, Path]:
    """The ssh folder's files: host key, client key, authorized_keys, known_hosts, config."""
    folder = directory / "ssh"
    return {
        "folder": folder,
        "host_key": folder / "host_ed25519",
        "identity": folder / "client_ed25519",
        "authorized_keys": folder / "authorized_keys",
        "known_hosts": folder / "known_hosts",
        "config": folder / "sshd_config",
    }


def _keygen(path: Path, comment: str) -> None:
    """An ed25519 key pair at path (kept when present: clients have learned it)."""
    if not path.exists():
        subprocess.run(
            [system_binary("ssh-keygen", "openssh-client"), "-q", "-t", "ed25519", "-N", ""]
            + ["-C", comment, "-f", str(path)],
            check=True,
            capture_output=True,
        )


def sshd_marker(directory: Path) -> str:
    """The config file argument of this stack's sshd."""
    return str(ssh_files(directory)["config"])


def sshd_command(cfg: Settings, credentials: Mapping[str, str]) -> Command:
    """sshd on 127.0.0.1 only, key login for this user only, no forwarding."""
    files = ssh_files(cfg.directory)
    files["folder"].mkdir(mode=0o700, exist_ok=True)
    _keygen(files["host_key"], "sparkforge-stack-host")
    _keygen(files["identity"], "sparkforge-stack-client")
    files["authorized_keys"].write_text(files["identity"].with_suffix(".pub").read_text())
    host_public = files["host_key"].with_suffix(".pub").read_text().split()[:2]
    files["known_hosts"].write_text(f"[{HOST}]:{cfg.ssh_port} {' '.join(host_public)}\n")
    files["config"].write_text(
        "\n".join(
            [
                f"Port {cfg.ssh_port}",
                f"ListenAddress {HOST}",
                f"HostKey {files['host_key']}",
                f"AuthorizedKeysFile {files['authorized_keys']}",
                f"AllowUsers {getpass.getuser()}",
                f"PidFile {files['folder'] / 'sshd.pid'}",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "UsePAM no",
                # The stack folder's owner and modes are the stack's, not a home's.
                "StrictModes no",
                # Engines are reached by `docker system dial-stdio` sessions, not forwards.
                "DisableForwarding yes",
                "PrintMotd no",
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        # sshd refuses to start without its privilege separation folder.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    argv = [system_binary("sshd", "openssh-server"), "-D", "-e", "-f", str(files["config"])]
    return Command(argv, clean_env(("SSH_",)), (cfg.ssh_port,))


def sshd_answers(endpoint: str) -> bool:
    """Whether an SSH server greets at host:port."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2) as conn:
            return conn.recv(8).startswith(b"SSH-")
    except OSError:
        return False
