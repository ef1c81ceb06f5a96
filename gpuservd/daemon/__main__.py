"""`python -m gpuservd.daemon`: run the daemon (the same as the `gpuservd` command)."""

from gpuservd.daemon import main

main()
