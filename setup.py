"""The build of kvatlas' one C extension; everything else is in pyproject.toml.

`kvatlas.wire._token_digits` (the JSON token parser of `kvatlas.wire.json_tokens`) is
optional: where no C compiler is found the install goes on without it, and the numpy
parse takes its place (slower, same answers).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvatlas.wire._token_digits",
            ["src/kvatlas/wire/_token_digits.c"],
            optional=True,
        )
    ]
)
