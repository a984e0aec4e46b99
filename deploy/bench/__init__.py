"""The benchmarks behind ``isthmus bench``: the emulated WAN, the cross-site
all-reduce, codecs, the packet-level hosts and Gloo's baseline, calibration."""
