// Command cdicheck is the test suite's real CDI consumer: it loads CDI spec
// directories with the library that containerd and CRI-O use, fails on any
// spec error, injects the given device ids into an empty OCI runtime spec and
// prints the resulting spec as JSON.
//
//	cdicheck [-dir D]... [ID]...
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

type dirList []string

func (d *dirList) String() string     { return strings.Join(*d, ",") }
func (d *dirList) Set(v string) error { *d = append(*d, v); return nil }

func main() {
	var dirs dirList
	flag.Var(&dirs, "dir", "CDI spec directory (repeatable; default /etc/cdi and /var/run/cdi)")
	list := flag.Bool("list", false, "print the qualified device names found and exit")
	flag.Parse()
	if len(dirs) == 0 {
		dirs = dirList{cdi.DefaultStaticDir, cdi.DefaultDynamicDir}
	}

	cache, err := cdi.NewCache(cdi.WithSpecDirs(dirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		fail("creating CDI cache: %v", err)
	}
	if err := cache.Refresh(); err != nil {
		fail("loading CDI specs: %v", err)
	}
	if errs := cache.GetErrors(); len(errs) > 0 {
		paths := make([]string, 0, len(errs))
		for p := range errs {
			paths = append(paths, p)
		}
		sort.Strings(paths)
		for _, p := range paths {
			for _, e := range errs[p] {
				fmt.Fprintf(os.Stderr, "cdicheck: %s: %v\n", p, e)
			}
		}
		os.Exit(1)
	}
	if *list {
		for _, name := range cache.ListDevices() {
			fmt.Println(name)
		}
		return
	}

	spec := &oci.Spec{Version: oci.Version, Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, flag.Args()...)
	if err != nil {
		fail("injecting %v (unresolved %v): %v", flag.Args(), unresolved, err)
	}
	out, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		fail("encoding OCI spec: %v", err)
	}
	fmt.Println(string(out))
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "cdicheck: "+format+"\n", args...)
	os.Exit(1)
}
