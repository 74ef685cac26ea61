"""`sparseforge bench`: registered by the kernel-generation stage."""


def add_bench_parser(sub) -> None:
    return None
