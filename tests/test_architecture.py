"""The import structure the code is laid out by: floors (model <- train <-
configs <- experiments), train/'s rooms in the order train/__init__.py
lists them, and no import circle anywhere."""

import ast
import pathlib
import re

import pytest

from tests.helpers import REPO
import train

pytestmark = pytest.mark.core
FLOORS = ('model', 'train', 'configs', 'experiments')


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {_module_name(path): path for floor in FLOORS
           for path in (REPO / floor).rglob('*.py')}


def _imports(name: str) -> set[str]:
  """The project's modules `name` imports, anywhere in it (a package's
  submodule where `from package import submodule`)."""
  path = MODULES[name]
  package = name if path.name == '__init__.py' else name.rpartition('.')[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        parent = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(parent + ([base] if base else []))
      targets = [f'{base}.{alias.name}' if f'{base}.{alias.name}' in MODULES
                 else base for alias in node.names]
    else:
      continue
    for target in targets:
      while target and target not in MODULES:
        target = target.rpartition('.')[0]
      if target and target != name:
        found.add(target)
  return found


IMPORTS = {name: _imports(name) for name in MODULES}


def test_no_import_circle():
  # Depth-first search; a module met again on the current path closes a
  # circle.
  done, path = set(), []

  def visit(name):
    if name in path:
      circle = path[path.index(name):] + [name]
      raise AssertionError('import circle: ' + ' -> '.join(circle))
    if name in done:
      return
    path.append(name)
    for target in sorted(IMPORTS[name]):
      visit(target)
    path.pop()
    done.add(name)

  for name in sorted(MODULES):
    visit(name)


def test_each_floor_imports_only_the_floors_below():
  upward = [f'{name} -> {target}' for name, targets in IMPORTS.items()
            for target in targets
            if FLOORS.index(target.split('.')[0])
            > FLOORS.index(name.split('.')[0])]
  assert not upward


def test_each_room_of_attention_imports_only_the_rooms_listed_before_it():
  """core/ <- kernels/ <- variants/, as model/attention/__init__.py lists
  them; the registry above them is no room."""
  from model import attention
  rooms = re.findall(r'^  (\w+)/ ', attention.__doc__, flags=re.M)
  assert sorted(rooms) == sorted(
      path.parent.name
      for path in (REPO / 'model' / 'attention').glob('*/__init__.py'))
  room = lambda name: (name.split('.')[2] if name.startswith(
      'model.attention.') and name.split('.')[2] in rooms else None)
  later = [f'{name} -> {target}' for name, targets in IMPORTS.items()
           if room(name) for target in targets
           if room(target) and rooms.index(room(target))
           > rooms.index(room(name))]
  assert not later


def test_each_room_of_train_imports_only_the_rooms_listed_before_it():
  rooms = re.findall(r'^  (\w+)/ ', train.__doc__, flags=re.M)
  assert sorted(rooms) == sorted(
      path.parent.name for path in (REPO / 'train').glob('*/__init__.py'))
  room = lambda name: name.split('.')[1] if name.count('.') > 1 else None
  later = [f'{name} -> {target}' for name, targets in IMPORTS.items()
           if room(name) for target in targets
           if target.startswith('train.') and (
               room(target) is None
               or rooms.index(room(target)) > rooms.index(room(name)))]
  assert not later
