"""The datasets pane's tabs, one widget per tab (records, findings, gallery, splits and groups,
stats, leaks and duplicates). Each takes the open `DatasetTable` through `set_table` and says
what the user asked for through signals; what to show comes from `app.viewmodels.datasets`."""
