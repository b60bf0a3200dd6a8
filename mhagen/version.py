"""mhagen's version (leaf module)."""
__version__ = "0.1.0"


def version_text() -> str:
    """`mhagen --version`: mhagen's version and the TVM it compiles with (read from the
    installed packages' metadata: importing TVM would take a second)."""
    from importlib import metadata

    def installed(package):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"
    return (f"mhagen {__version__} (TVM {installed('apache-tvm')}, tvm-ffi "
            f"{installed('apache-tvm-ffi')})")
