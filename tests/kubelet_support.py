"""What a kubelet does with one pod of a rendered chart, as local processes.

`PodRuntime` builds a pod's files and its containers' command lines from the pod spec,
strictly: a Secret or ConfigMap key that is missing (and not optional), a claim nothing
maps, an image with no local stand-in or a field this emulator does not know is a
`PodError` naming it, as a kubelet would refuse to start the container. Each container
runs as

    ip netns exec <pod netns> unshare --mount --uts --pid --fork --kill-child --mount-proc
        sh -c 'hostname <pod>; mount --bind <volume> <mountPath> ...; mount -o remount,ro /;
               cd <workdir>; exec setpriv --reuid <runAsUser> ... <command> <args>'

so it has the pod's network and name, the volumes at their mount paths (and nothing
else writable with ``readOnlyRootFilesystem``), its own PID namespace (SIGKILL of its
first process ends all of it), the user, groups and capabilities of its securityContext,
and exactly its environment. Images map to this machine: an Etude image's venv to the
repository's venv and its working directory to the repository; the redis image to the
host's redis-server. Probes and restarts are tests/pod_lifecycle.py.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class PodError(RuntimeError):
    """The pod cannot be started as specified (a kubelet's CreateContainerConfigError)."""


@dataclass(frozen=True)
class Image:
    """The local stand-in of an image: its entrypoint, working directory and environment."""

    entrypoint: list[str]
    workdir: str
    env: dict[str, str]


def etude_image() -> Image:
    # Dockerfile: venv on PATH, WORKDIR /opt/etude, ENTRYPOINT etude-entrypoint (etude).
    return Image(
        entrypoint=["etude"],
        workdir=str(REPO),
        env={
            "PATH": f"{VENV}/bin:{SYSTEM_PATH}",
            "VIRTUAL_ENV": str(VENV),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO),  # the image installs the package; here the repo is it
        },
    )


def local_image(reference: str) -> Image:
    """The stand-in of an image reference; PodError for one this machine has none of."""
    repository = reference.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    if repository.startswith("etude-"):
        return etude_image()
    if repository == "redis":
        # The official image builds redis-server with protected mode off by default.
        entrypoint = ["redis-server", "--protected-mode", "no"]
        return Image(entrypoint=entrypoint, workdir="/data", env={"PATH": SYSTEM_PATH})
    raise PodError(f"no local stand-in for image {reference!r}")


@dataclass
class PodContext:
    """What resolving a pod needs from the cluster."""

    name: str
    namespace: str
    ip: str
    labels: dict[str, str]
    service_account: str
    config_maps: dict[str, dict[str, str]]
    secrets: dict[str, dict[str, str]]  # values decoded
    claims: dict[str, Path]  # claim name -> host directory
    root: Path  # this pod's directory on the host
    made_paths: Callable[[Path], None]  # registers a host mount point created for a pod


def _field_ref(ctx: PodContext, path: str) -> str:
    simple = {
        "metadata.name": ctx.name,
        "metadata.namespace": ctx.namespace,
        "status.podIP": ctx.ip,
        "status.hostIP": ctx.ip,
        "spec.nodeName": "node-0",
        "spec.serviceAccountName": ctx.service_account,
    }
    if path in simple:
        return simple[path]
    match = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
    if match and match[1] in ctx.labels:
        return ctx.labels[match[1]]
    raise PodError(f"fieldRef {path!r} is not one this emulator (or the pod) has")


def _key_ref(ctx: PodContext, kind: str, ref: dict[str, Any], what: str) -> str | None:
    store = ctx.secrets if kind == "secret" else ctx.config_maps
    source = store.get(ref["name"])
    if source is None or ref["key"] not in source:
        if ref.get("optional"):
            return None
        missing = "" if source is None else f" has no key {ref['key']!r}"
        raise PodError(f"{what}: {kind} {ref['name']!r}{missing or ' not found'}")
    return source[ref["key"]]


def container_env(ctx: PodContext, container: dict[str, Any], image: Image) -> dict[str, str]:
    """The image's environment, HOSTNAME, envFrom, then env (with $(VAR) expansion)."""
    env = {**image.env, "HOSTNAME": ctx.name}
    for source in container.get("envFrom", []):
        kind = "secret" if "secretRef" in source else "configMap"
        ref = source.get("secretRef") or source["configMapRef"]
        data = (ctx.secrets if kind == "secret" else ctx.config_maps).get(ref["name"])
        if data is None and not ref.get("optional"):
            raise PodError(f"envFrom: {kind} {ref['name']!r} not found")
        for key, value in (data or {}).items():
            env[source.get("prefix", "") + key] = value
    for var in container.get("env", []):
        name, value = var["name"], var.get("value")
        source = var.get("valueFrom")
        if source is not None:
            what = f"env {name}"
            if "secretKeyRef" in source:
                value = _key_ref(ctx, "secret", source["secretKeyRef"], what)
            elif "configMapKeyRef" in source:
                value = _key_ref(ctx, "configMap", source["configMapKeyRef"], what)
            elif "fieldRef" in source:
                value = _field_ref(ctx, source["fieldRef"]["fieldPath"])
            else:
                raise PodError(f"{what}: valueFrom {sorted(source)} not emulated")
            if value is None:
                continue
        value = re.sub(
            r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value or ""
        )
        env[name] = value
    return env


@dataclass
class Volume:
    host: Path
    tmpfs_bytes: int | None = None  # emptyDir medium Memory


def _quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1000, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text))
    if not match or (match[2] and match[2] not in units):
        raise PodError(f"quantity {text!r} not understood")
    return int(match[1]) * units.get(match[2], 1)


def _write_keys(target: Path, data: dict[str, str], spec: dict[str, Any], what: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    items = spec.get("items") or [{"key": key, "path": key} for key in data]
    for item in items:
        if item["key"] not in data:
            raise PodError(f"{what} has no key {item['key']!r}")
        path = target / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data[item["key"]])
        path.chmod(item.get("mode", spec.get("defaultMode", 0o644)))


def pod_volumes(
    ctx: PodContext, spec: dict[str, Any], templates: dict[str, Path], fs_group: int | None
) -> dict[str, Volume]:
    """Every volume of the pod on the host; `templates` are its volumeClaimTemplates' dirs."""
    volumes = {name: Volume(path) for name, path in templates.items()}
    for volume in spec.get("volumes", []):
        name = volume["name"]
        here = ctx.root / "volumes" / name
        if "configMap" in volume or "secret" in volume:
            kind = "secret" if "secret" in volume else "configMap"
            ref = volume[kind]
            ref_name = ref.get("secretName") if kind == "secret" else ref.get("name")
            data = (ctx.secrets if kind == "secret" else ctx.config_maps).get(ref_name or "")
            if data is None:
                raise PodError(f"volume {name}: {kind} {ref_name!r} not found")
            _write_keys(here, data, ref, f"volume {name}: {kind} {ref_name!r}")
            volumes[name] = Volume(here)
        elif "emptyDir" in volume:
            here.mkdir(parents=True, exist_ok=True)
            here.chmod(0o777)  # as a kubelet makes an emptyDir
            medium = volume["emptyDir"] or {}
            size = medium.get("sizeLimit", "64Mi") if medium.get("medium") == "Memory" else None
            volumes[name] = Volume(here, _quantity_bytes(size) if size else None)
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in ctx.claims:
                raise PodError(f"volume {name}: PersistentVolumeClaim {claim!r} is not bound")
            volumes[name] = Volume(ctx.claims[claim])
        else:
            raise PodError(f"volume {name}: source {sorted(volume)} not emulated")
    if fs_group is not None:  # a kubelet gives the pod's volumes to its fsGroup
        for name, volume in volumes.items():
            if volume.tmpfs_bytes is None and volume.host.is_dir() and name != "config":
                os.chown(volume.host, -1, fs_group)
                volume.host.chmod(volume.host.stat().st_mode | 0o2070)
    return volumes


def _interpreter_lines(stage: Path) -> list[str]:
    """Mounts that make this machine's Python readable by a pod's non-root user, as the
    image's own interpreter is: an ancestor it cannot traverse (pyenv's under /root) is
    covered by an empty tmpfs that holds only the interpreter's tree."""
    base = Path(sys.base_prefix).resolve()
    hidden = next((a for a in reversed(base.parents) if not a.stat().st_mode & 0o001), None)
    if hidden is None:
        return []
    stage.mkdir(parents=True, exist_ok=True)
    return [
        f"mount --bind {base} {stage}",
        f"mount -t tmpfs -o mode=755,size=1m tmpfs {hidden}",
        f"mkdir -p {base}",
        f"mount --move {stage} {base}",
    ]


def _mount_point(path: Path, is_file: bool, made: Callable[[Path], None]) -> None:
    """Creates a missing mount point on the host (registered, removed at the end)."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for created in reversed(missing):
        if created == path and is_file:
            created.touch()
        else:
            created.mkdir()
        made(created)


@dataclass
class ContainerCommand:
    """A container ready to start: its argv (the wrapper) and its environment."""

    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)


def container_command(
    ctx: PodContext,
    netns: str,
    pod_spec: dict[str, Any],
    container: dict[str, Any],
    volumes: dict[str, Volume],
) -> ContainerCommand:
    """The wrapper that runs `container` as a kubelet would (see the module docstring)."""
    image = local_image(container["image"])
    env = container_env(ctx, container, image)
    pod_security = pod_spec.get("securityContext", {})
    security = {**pod_security, **container.get("securityContext", {})}
    uid, gid = security.get("runAsUser"), security.get("runAsGroup")
    if security.get("runAsNonRoot") and not uid:
        raise PodError(f"container {container['name']}: runAsNonRoot without a runAsUser")
    lines = ["set -e", f"hostname {shlex.quote(ctx.name)}"]
    if uid:
        lines += _interpreter_lines(ctx.root / "interpreter")
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: m["mountPath"].count("/"))
    # The image's code: where a volume covers the repository (a checkout under /tmp, which
    # the pod mounts an emptyDir over), it is moved back on top afterwards, as the image's
    # files would stay visible beside the pod's /tmp.
    covers_repo = any(
        Path(mount["mountPath"]) in (REPO, *REPO.parents) and Path(mount["mountPath"]) != Path("/")
        for mount in mounts
    )
    repo_stage = ctx.root / "repository"
    if covers_repo:
        repo_stage.mkdir(parents=True, exist_ok=True)
        lines.append(f"mount --bind {shlex.quote(str(REPO))} {shlex.quote(str(repo_stage))}")
    for mount in mounts:
        if mount["name"] not in volumes:
            raise PodError(f"volumeMount {mount['mountPath']}: no volume {mount['name']!r}")
        volume = volumes[mount["name"]]
        source = volume.host / mount["subPath"] if mount.get("subPath") else volume.host
        if mount.get("subPath") and not source.exists():
            source.mkdir(parents=True)  # a kubelet creates a missing subPath as a directory
        target = Path(mount["mountPath"])
        _mount_point(target, source.is_file(), ctx.made_paths)
        if volume.tmpfs_bytes:
            lines.append(f"mount -t tmpfs -o size={volume.tmpfs_bytes} tmpfs {target}")
        else:
            lines.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}")
        if mount.get("readOnly"):
            lines.append(f"mount -o remount,bind,ro {shlex.quote(str(target))}")
    if covers_repo:
        lines.append(f"mkdir -p {shlex.quote(str(REPO))}")
        lines.append(f"mount --move {shlex.quote(str(repo_stage))} {shlex.quote(str(REPO))}")
    if security.get("readOnlyRootFilesystem"):
        lines.append("mount -o remount,bind,ro /")
    lines.append(f"cd {shlex.quote(container.get('workingDir', image.workdir))}")
    # command replaces the image's entrypoint, args its default arguments.
    argv = list(container.get("command") or image.entrypoint) + list(container.get("args", []))
    argv = [
        re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in argv
    ]
    drop = security.get("capabilities", {}).get("drop", [])
    setpriv = ["setpriv"]
    if uid is not None:
        setpriv += [f"--reuid={uid}", f"--regid={gid if gid is not None else uid}"]
        fs_group = pod_security.get("fsGroup")
        setpriv += [f"--groups={fs_group}"] if fs_group is not None else ["--clear-groups"]
    if "ALL" in drop:
        setpriv += ["--inh-caps=-all", "--bounding-set=-all"]
    if security.get("allowPrivilegeEscalation") is False:
        setpriv.append("--no-new-privs")
    lines.append("exec " + shlex.join(setpriv + argv))
    wrapper = ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--pid", "--fork"]
    wrapper += ["--kill-child", "--mount-proc", "--propagation", "private"]
    ports = {
        p.get("name", str(p["containerPort"])): p["containerPort"]
        for p in container.get("ports", [])
    }
    return ContainerCommand([*wrapper, "sh", "-c", "\n".join(lines)], env, ports)


def decode_secret(manifest: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in manifest.get("data", {}).items()}
    return {**data, **manifest.get("stringData", {})}


def start(command: ContainerCommand, log: Path) -> subprocess.Popen[bytes]:
    """Starts the container; its output is appended to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            command.argv,
            env=command.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def container_pid(wrapper: subprocess.Popen[bytes]) -> int | None:
    """Host PID of the container's first process (the wrapper's child, PID 1 inside)."""
    try:
        children = Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None
