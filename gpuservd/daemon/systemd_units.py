"""The systemd unit files, rendered in one place.

`gpuserv systemd install [--user]` writes them with the path of this
installation's `gpuservd`; the copies in the repository's `systemd/` are the
same text rendered for `/usr/local/bin/gpuservd` (a test keeps them equal).

System units run the daemon as the `gpuserv` user (created by
systemd-sysusers from gpuserv.sysusers.conf), take the socket from
gpuservd.socket (socket activation: clients can connect while the daemon
starts or restarts), and sandbox it. User units are the same minus what a
user manager cannot do (User=, device and filesystem sandboxing).
"""

from __future__ import annotations

DEFAULT_EXEC = "/usr/local/bin/gpuservd"

_SYSTEM_HARDENING = """\
# Hardening. Not MemoryDenyWriteExecute (PyTorch and CUDA generate code) and not
# PrivateDevices (it would hide the GPUs).
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
ProtectClock=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictNamespaces=yes
LockPersonality=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
DevicePolicy=closed
# /dev/nvidia*: DeviceAllow= globs device *group* names from /proc/devices, not paths;
# char-nvidia* covers nvidia-frontend (/dev/nvidia0.., /dev/nvidiactl), nvidia-uvm,
# nvidia-caps (MIG) and nvidia-modeset.
DeviceAllow=char-nvidia* rw
"""


def service(exec_path: str = DEFAULT_EXEC, user: bool = False) -> str:
    """gpuservd.service."""
    who = "" if user else "User=gpuserv\nGroup=gpuserv\n"
    dirs = ("RuntimeDirectory=gpuserv\nRuntimeDirectoryPreserve=yes\n" if user else
            "RuntimeDirectory=gpuserv\nRuntimeDirectoryMode=0755\n"
            "# The socket unit keeps listening in /run/gpuserv across restarts of the service.\n"
            "RuntimeDirectoryPreserve=yes\n"
            "StateDirectory=gpuserv\nStateDirectoryMode=0750\n"
            "CacheDirectory=gpuserv\nConfigurationDirectory=gpuserv\n"
            "Environment=XDG_CACHE_HOME=%C/gpuserv\n")
    hardening = "NoNewPrivileges=yes\n" if user else _SYSTEM_HARDENING
    return f"""\
# gpuservd.service: the gpuserv model-serving daemon (written by `gpuserv systemd install{' --user' if user else ''}`).
# Config: /etc/gpuserv/gpuserv.yaml (built-in defaults when absent{'; another file: Environment=GPUSERV_CONFIG= in `systemctl --user edit gpuservd`' if user else ''}).
# Models: {'~/.local/share/gpuserv/models' if user else '/var/lib/gpuserv/models'}.
[Unit]
Description=gpuserv model-serving daemon
Requires=gpuservd.socket
After=gpuservd.socket{'' if user else ' network.target'}

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_path}
# SIGHUP re-reads the config and tenants without dropping a request.
ExecReload=/bin/kill -HUP $MAINPID
# SIGTERM drains: no new requests (503), in-flight ones finish up to server.drain_timeout
# (30 s by default), the rest end with finish reason "abort"; then it exits 0.
KillMode=mixed
TimeoutStopSec=90s
# Loading a large model from disk can take minutes.
TimeoutStartSec=300s
# Pinged only while every engine loop makes progress: a wedged engine is restarted.
WatchdogSec=60s
Restart=on-failure
RestartSec=2s
LimitNOFILE=65536
{who}{dirs}{hardening}
[Install]
WantedBy={'default.target' if user else 'multi-user.target'}
"""


def socket_unit(user: bool = False) -> str:
    """gpuservd.socket."""
    where = "%t/gpuserv/gpuserv.sock" if user else "/run/gpuserv/gpuserv.sock"
    owner = "SocketMode=0600\n" if user else (
        "# Members of the gpuserv group may talk to the daemon; the daemon maps each peer's uid\n"
        "# to a tenant (profiles/tenants.yaml).\n"
        "SocketUser=gpuserv\nSocketGroup=gpuserv\nSocketMode=0660\n")
    return f"""\
# gpuservd.socket: the daemon's Unix socket, held by systemd (socket activation).
[Unit]
Description=gpuserv daemon socket

[Socket]
ListenStream={where}
{owner}DirectoryMode=0755
RemoveOnStop=yes
Backlog=2048

[Install]
WantedBy=sockets.target
"""


SYSUSERS = """\
# systemd-sysusers(8): the user the system gpuservd.service runs as.
u gpuserv - "gpuserv model-serving daemon" /var/lib/gpuserv
"""
