"""Native kernels: C++ CPU kernels built on first use (``cpu.py``, sources in ``csrc/``)."""
