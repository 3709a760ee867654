"""Ranks that run in OCI containers: which container a worker is in (ref.py), what a host needs to
run it (needs.py), the container's configuration as it travels (config.py), and the container
runtime's own checkpoint and restore, driven so that the images are pitstop's (podman.py).

Why the runtime's checkpoint: a container's mount namespace (its image's root, bind mounts,
masked paths, tmpfs and /dev/shm contents), its cgroups and its namespaces are what runc's
checkpoint code already hands to CRIU correctly, and only the runtime can make the spare's
runtime know the restored container (listed, stopped, its logs read there).  pitstop keeps
everything around it: the cut, the stream, the verification, the release, the rollback and the
commit (docs/architecture.md, "Ranks in containers")."""
