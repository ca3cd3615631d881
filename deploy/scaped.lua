-- scaped.lua - Lmod modulefile for an installed scaped.  `cmake --install`
-- puts it in <prefix>/share/modulefiles/scaped/<version>.lua, so
-- `module use <prefix>/share/modulefiles; module load scaped` works for any
-- prefix: the root is found from where this file is.
help([[
scaped: the SCAPE optimizer daemon (scaped), its CLI (scapectl), the trainer
library libscape (C, pkg-config `scape`, CMake `find_package(Scape)`) and the
sbatch templates in $SCAPE_HOME/slurm.
]])
whatis("Name: scaped")
whatis("Description: SCAPE sparse-communication optimizer daemon for data-parallel training")

local root = myFileName():gsub("/share/modulefiles/scaped/[^/]+$", "")
local libdir = pathJoin(root, "lib")

setenv("SCAPE_HOME", root)
prepend_path("PATH", pathJoin(root, "bin"))
prepend_path("LD_LIBRARY_PATH", libdir)
prepend_path("PKG_CONFIG_PATH", pathJoin(libdir, "pkgconfig"))
prepend_path("CMAKE_PREFIX_PATH", root)
