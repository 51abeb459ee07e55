"""The Qt-free data layer: dataset formats, validation, splits, leaks, statistics, cards."""
