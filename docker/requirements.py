"""Prints the project's requirements from pyproject.toml alone, with those of the extras named as
arguments: the images install them in a layer of their own, before the source is copied in."""

import sys
import tomllib

with open("pyproject.toml", "rb") as file:
    project = tomllib.load(file)["project"]
extras = [requirement for extra in sys.argv[1:] for requirement in project["optional-dependencies"][extra]]
print("\n".join(project["dependencies"] + extras))
