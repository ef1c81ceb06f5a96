import time, sys
busy = float(sys.argv[1]) * 1e-6; idle = float(sys.argv[2]) * 1e-3
end = time.time() + float(sys.argv[3])
n = 0
while time.time() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < busy: pass
    time.sleep(idle); n += 1
print("compete wakes", n)
