"""`python -m console` (the same as `gpuserv top`)."""

from console.cli import main

main()
