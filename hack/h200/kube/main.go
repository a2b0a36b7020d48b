// Command kube is one multi-call binary for the Kubernetes components that the H200 device
// run needs: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and etcd.
// It picks the component by the name it was started as (a hard link or a symlink named
// after it), or by its first argument. One binary instead of five because the device tool
// carries at most 64 MiB per call, and the components share most of their code.
//
// Each case does what the upstream main package of that component does (the same command
// constructor, the same blank imports above); nothing else lives here.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	_ "time/tzdata" // as kube-apiserver and kube-controller-manager: CronJob time zones

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var components = map[string]func(args []string) int{
	"kube-apiserver": func([]string) int { return cli.Run(apiserver.NewAPIServerCommand()) },
	"kube-controller-manager": func([]string) int {
		return cli.Run(controllermanager.NewControllerManagerCommand())
	},
	"kube-scheduler": func([]string) int { return cli.Run(scheduler.NewSchedulerCommand()) },
	"kubelet":        func([]string) int { return cli.Run(kubelet.NewKubeletCommand(context.Background())) },
	"etcd": func(args []string) int {
		etcdmain.Main(args)
		return 0
	},
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := components[name]; !ok && len(os.Args) > 1 {
		if _, ok := components[os.Args[1]]; ok {
			// `kube <component> args...`: the component sees itself as argv[0].
			name = os.Args[1]
			os.Args = os.Args[1:]
		}
	}
	run, ok := components[name]
	if !ok {
		names := make([]string, 0, len(components))
		for n := range components {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprintf(os.Stderr, "usage: link this binary as one of %s, or run it as `%s <component> ...`\n",
			strings.Join(names, ", "), filepath.Base(os.Args[0]))
		os.Exit(2)
	}
	os.Exit(run(os.Args))
}
