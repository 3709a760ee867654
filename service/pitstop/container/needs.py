"""What a host needs to run a container that moves in, asked before anything pauses.

A restore that fails after the job paused costs the whole pause and a rollback; each of these
would fail it, and each is a question the spare answers in milliseconds:
- podman itself, and the container's OCI runtime with checkpoint support (runc; crun only where
  built with CRIU: Debian's is not);
- the container's image, by id (a tag can name another image on the spare);
- every bind mount's source (the agent's own socket directory excepted: the spare's is used);
- every device the container was given;
- the container's name, free (podman re-creates the container under its own name).
Each lack is named with what to do about it.
"""

from __future__ import annotations

import os
from typing import Any

from pitstop.container.podman import Podman, runtime_cannot_checkpoint
from pitstop.errors import PitstopError


def record(info: dict[str, Any]) -> dict[str, Any]:
    """What a container's move needs to know of it, from podman's inspect record."""
    host = info.get("HostConfig") or {}
    return {
        "id": info.get("Id", ""),
        "name": (info.get("Name") or "").lstrip("/"),
        "image": info.get("Image", ""),
        "image_name": info.get("ImageName", ""),
        "runtime": info.get("OCIRuntime") or "runc",
        "static_dir": info.get("StaticDir", ""),
        "network": host.get("NetworkMode", ""),
        "auto_remove": bool(host.get("AutoRemove")),
        "mounts": [{"source": m.get("Source", ""), "destination": m.get("Destination", "")}
                   for m in info.get("Mounts") or [] if m.get("Type") == "bind"],
        "devices": sorted({d.get("PathOnHost", "") for d in host.get("Devices") or [] if d.get("PathOnHost")}),
    }


def lacking(pod: Podman, container: dict[str, Any], socket_dir: str) -> list[dict[str, str]]:
    """What this host lacks of `container`'s needs: [{path, why}], empty when it has them all."""
    out: list[dict[str, str]] = []
    name = container.get("name") or container.get("id", "")[:12]
    version = pod.version()
    if version is None:
        return [{"path": "podman", "why": "podman is not installed or does not run here; install podman and runc"}]
    why = runtime_cannot_checkpoint(container.get("runtime") or "runc")
    if why:
        out.append({"path": f"OCI runtime {container.get('runtime')}",
                    "why": f"{why}; install runc, or a crun built with CRIU"})
    image = container.get("image") or ""
    if image and not pod.image_exists(image):
        out.append({"path": f"image {container.get('image_name') or image[:12]} ({image[:12]})",
                    "why": "not in this host's podman storage; pull or load the same image here"})
    own = container.get("socket_dir")
    for m in container.get("mounts") or []:
        src = m.get("source") or ""
        if src and src != own and not os.path.exists(src):
            out.append({"path": src, "why": f"the source of the bind mount at {m.get('destination')} of container "
                                            f"{name} does not exist here; make it (the same data, or a shared "
                                            "file system)"})
    for d in container.get("devices") or []:
        if not os.path.exists(d):
            out.append({"path": d, "why": f"container {name} was given this device, which this host lacks"})
    if container.get("name"):
        try:
            there = pod.inspect(container["name"])
        except PitstopError:
            there = None
        if there is not None and there.get("Id") != container.get("id"):
            out.append({"path": f"container name {container['name']}",
                        "why": f"taken here by container {there.get('Id', '')[:12]}; remove or rename it"})
    return out
