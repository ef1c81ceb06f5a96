"""Hand a listening socket to a command the way systemd does: as fd 3, LISTEN_FDS=1, LISTEN_PID=<its pid>.

usage: python listen_fds_wrapper.py FD COMMAND... (exec keeps the pid, so LISTEN_PID is the daemon's)
"""

import os
import sys

fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.set_inheritable(3, True)
os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES="gpuservd.socket")
os.execvp(sys.argv[2], sys.argv[2:])
