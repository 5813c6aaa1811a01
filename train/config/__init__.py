"""A user's config checked before anything compiles: every training key
and its rule (keys), the model on its data and backend (validation), and
its layout on the mesh (layout); a mistake is an InputError naming the key.
Imports train.base, train.data, train.program and train.decode."""
