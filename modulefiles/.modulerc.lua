-- The Tcl twins under tcl/ are for Environment Modules sites (module use .../modulefiles/tcl);
-- keep them out of "module avail" when Lmod users add this directory.
hide_version("tcl/eddis/0.1.0")
