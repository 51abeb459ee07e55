"""Qt-free view-models: everything the panes show, computed from workspace and run-directory
files through the engine's torch-free readers. Tested without Qt."""
