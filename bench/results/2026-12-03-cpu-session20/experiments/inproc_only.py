import sys, os
sys.argv = ["x", "0"]
exec(open("/tmp/s20/split.py").read().split("for i in range(int(sys.argv[1]))")[0])
for i in range(int(os.environ.get("N", "2"))):
    inproc()
