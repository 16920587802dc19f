import ctypes, runpy, sys
libc = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
for name, param, value in [("arena", M_ARENA_MAX, 1), ("mmap", M_MMAP_MAX, 0), ("trim", M_TRIM_THRESHOLD, 2**31 - 1)]:
    if name in sys.argv[1].split(","):
        assert libc.mallopt(param, value) == 1, name
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
