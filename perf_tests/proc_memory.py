"""Process memory from /proc (Linux), without torch: the resident size and its
high-water mark (VmRSS, VmHWM), and a reset of the mark so one run's peak can be
read alone. Shared by torch_baseline.py, examples/torch_ssm.py and
examples/long_range.py."""


def vm_kib(field):
    """A /proc/self/status field in KiB ("VmRSS", "VmHWM"); 0 where it is missing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_rss_peak():
    """Resets VmHWM to the current RSS (clear_refs 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
